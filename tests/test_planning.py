"""The planning facts (``hf_hilbert_attn/planning.py``) against brute force over every pair of
small random patterns: segments and sliding windows, sinks, per_head and all, causal and not."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from helpers import random_pattern

from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn import planning
from hf_hilbert_attn.kernels._plan import W_CAP, config_order

N = 36  # positions 0..N-1
HEADS = 12  # every class of the rates below has a head (rates <= 6 divide 12 or reach it)
SEEDS = range(40)
H = torch.arange(HEADS).view(-1, 1, 1)
P = torch.arange(N).view(1, -1, 1)
S = torch.arange(N).view(1, 1, -1)


def _pattern(seed: int, window=None, sinks=0) -> DilatedPattern:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # covered configs are welcome here
        return random_pattern(random.Random(seed), max_w=14, min_w=1, max_rate=6, window=window,
                              sinks=sinks)


def _two(a, b, mode: str, window: str) -> DilatedPattern:
    """A pattern holding configs ``a`` (index 0) and ``b`` (index 1); a trailing (1, 1) makes
    per_head valid without allowing anything but ``p == s``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DilatedPattern([a[0], b[0], 1], [a[1], b[1], 1], query_dilation=mode,
                              window=window)


def _brute_pair(pattern, causal, q_rng, k_rng, configs=None) -> bool:
    """Some head allows some pair of the ranges (all configs and the sinks, or only the config
    indices in ``configs``)."""
    p, s = P[:, q_rng[0]:q_rng[1] + 1], S[:, :, k_rng[0]:k_rng[1] + 1]
    if configs is None:
        ok = pattern.allowed(H, p, s)
    else:
        ok = torch.zeros((), dtype=torch.bool)
        for i in configs:
            ok = ok | pattern.config_allowed(i, H, p, s)
    if causal:
        ok = ok & (s <= p)
    return bool(ok.any())


def _ranges(rng: random.Random):
    a, b = sorted(rng.randrange(N) for _ in range(2))
    c, d = sorted(rng.randrange(N) for _ in range(2))
    return (a, b), (c, d)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("window", ["segment", "sliding"])
def test_meets_is_a_superset_and_exact_at_rate_one(seed, window):
    pattern = _pattern(seed, window=window, sinks=None)
    rng = random.Random(seed)
    for _ in range(30):
        causal = rng.random() < 0.5
        q_rng, k_rng = _ranges(rng)
        if _brute_pair(pattern, causal, q_rng, k_rng):
            assert planning.meets(pattern, causal, q_rng, k_rng), (pattern, q_rng, k_rng)
        for i, (w, r) in enumerate(pattern.configs):
            got = planning.config_meets(w, pattern.sliding, causal, q_rng, k_rng)
            want = _brute_pair(pattern, causal, q_rng, k_rng, [i])
            assert got or not want, (pattern, i, q_rng, k_rng, causal)
            if r == 1:
                assert got == want, (pattern, i, q_rng, k_rng, causal)


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_config_meets_on_tensors_equals_integers(sliding, causal):
    rng = random.Random(7)
    rows = [_ranges(rng) for _ in range(200)]
    qlo, qhi, klo, khi = (torch.tensor([x[a][b] for x in rows]) for a, b in
                          ((0, 0), (0, 1), (1, 0), (1, 1)))
    for w in (1, 3, 8, 40):
        got = planning.config_meets(w, sliding, causal, (qlo, qhi), (klo, khi))
        want = [bool(planning.config_meets(w, sliding, causal, q, k)) for q, k in rows]
        assert got.tolist() == want


@pytest.mark.parametrize("seed", SEEDS)
def test_period_shifts_leave_the_configs_rule(seed):
    pattern = _pattern(seed, window=random.Random(seed).choice(["segment", "sliding"]))
    per = planning.period(pattern)
    assert per == pattern.shift_period
    assert planning.period(pattern, per) == 0 and planning.period(pattern, per + 1) == per
    assert planning.period(None) == 0
    for i in range(pattern.num_configs):
        base = pattern.config_allowed(i, H, P, S)
        for k in (1, 2):
            if per * k + N < 1 << 20:
                assert torch.equal(base, pattern.config_allowed(i, H, P + k * per, S + k * per))


@pytest.mark.parametrize("seed", SEEDS)
def test_priority_orders_by_rate_and_keeps_the_union(seed):
    rng = random.Random(seed)
    pattern = _pattern(seed, window=rng.choice(["segment", "sliding"]))
    if rng.random() < 0.3:  # a repeated config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pattern = pattern.replace(segment_lengths=list(pattern.segment_lengths) * 2,
                                      dilation_rates=list(pattern.dilation_rates) * 2)
    order = planning.priority(pattern)
    cfgs = [pattern.configs[i] for i in order]
    assert cfgs == sorted(cfgs, key=lambda wr: (wr[1], wr[0]))
    assert len(set(cfgs)) == len(cfgs) and set(cfgs) == set(pattern.configs)
    assert planning.priority_configs(pattern) == cfgs
    union = torch.zeros((), dtype=torch.bool)
    for i in order:
        union = union | pattern.config_allowed(i, H, P, S)
    assert torch.equal(union.expand(HEADS, N, N), pattern.allowed(H, P, S).expand(HEADS, N, N))
    # the kernels' order is this one, segments capped at 2**30
    assert config_order(pattern)[0] == [(min(w, W_CAP), r) for w, r in cfgs]


def _groups(w: int, r: int, sliding: bool):
    """The class groups of config ``(w, r)`` over positions ``0..N-1``: ``(class, positions)``."""
    if sliding:
        return [(c, list(range(c, N, r))) for c in range(r)]
    return [(c, list(range(seg + c, min(seg + w, N), r))) for seg in range(0, N, w)
            for c in range(r)]


def _configs(rng: random.Random, n: int):
    return [(w, rng.randint(1, min(w, 6))) for w in (rng.randint(1, 14) for _ in range(n))]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sliding", [False, True])
def test_class_uniform(seed, sliding):
    """Uniform: the earlier config's class (``(p % wj) % rj``, sliding ``p % rj``) is one over the
    group, so its class test gives one answer to every pair and head (sliding: "allowed")."""
    rng = random.Random(seed)
    for (wj, rj), (w, r) in (_configs(rng, 2) for _ in range(20)):
        def cls(p):
            return p % rj if sliding else (p % wj) % rj

        for c, group in _groups(w, r, sliding):
            if planning.class_uniform((wj, rj), r, sliding):
                assert len({cls(p) for p in group}) <= 1, ((wj, rj), (w, r), group)
                if sliding and group:  # per_head: the group's heads (h % r == c) have it too
                    assert all(h % rj == cls(group[0]) for h in range(c, HEADS, r))
        assert planning.class_uniform((wj, rj), None, sliding) == (rj == 1)
        assert planning.class_uniform((wj, rj), r, sliding) or rj > 1


@pytest.mark.parametrize("seed", SEEDS)
def test_nests(seed):
    rng = random.Random(seed)
    for _ in range(40):
        wj, w, span = rng.randint(1, 12), rng.randint(1, 24), rng.randint(1, 6)
        if not planning.nests(wj, w, span):
            continue
        for seg in range(0, 4 * w, w):
            for a in range(seg, seg + w, span):
                run = range(a, min(a + span, seg + w))
                assert len({p // wj for p in run}) == 1, (wj, w, span, list(run))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["per_head", "all"])
@pytest.mark.parametrize("window", ["segment", "sliding"])
def test_covers(seed, mode, window):
    rng = random.Random(seed)
    hits = 0
    for _ in range(30):
        a, b = _configs(rng, 2)
        if rng.random() < 0.5:  # a pair built to cover (or nearly)
            rj = rng.randint(1, 3)
            rb = rj * rng.randint(1, 2)
            wb = rb * rng.randint(1, 3) + rng.choice([0, 0, 1])
            a, b = (wb * rng.randint(1, 2) + rng.choice([0, 0, 1]), rj), (wb, rb)
        if not planning.covers(a, b, window == "sliding"):
            continue
        hits += 1
        pat = _two(a, b, mode, window)
        later, earlier = pat.config_allowed(1, H, P, S), pat.config_allowed(0, H, P, S)
        assert not bool((later & ~earlier).any()), (a, b, mode, window)
    assert hits


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_covered_window(seed, mode):
    """Sliding: every pair of a class group (and its heads) within the covered window is
    allowed by an earlier config."""
    rng = random.Random(seed)
    earlier = _configs(rng, rng.randint(1, 3))
    r = rng.randint(1, 6)
    pat_rules = []
    for e in earlier:
        pat = _two(e, (1, 1), mode, "sliding")
        pat_rules.append(pat.config_allowed(0, H, P, S))
    taken = torch.stack([t.expand(HEADS, N, N) for t in pat_rules]).any(0)
    dist = (P - S).abs().expand(HEADS, N, N)
    for cls_r in (r, None):
        cov = planning.covered_window(earlier, cls_r)
        near = dist < cov
        if cls_r is not None:  # pairs of one class group of rate r, with the group's heads
            p, s, h = P.expand(HEADS, N, N), S.expand(HEADS, N, N), H.expand(HEADS, N, N)
            near &= (p % cls_r == s % cls_r)
            if mode == "per_head":
                near &= p % cls_r == h % cls_r
        assert not bool((near & ~taken).any()), (earlier, cls_r, cov)


def test_sink_keys():
    pat = DilatedPattern([8], [1], sink_tokens=5)
    assert [planning.sink_keys(pat, k) for k in (0, 4, 5)] == [5, 5, 0]
    assert planning.sink_keys(pat, 1, base=3) == 2 and planning.sink_keys(pat, 0, base=8) == 0
    assert planning.meets(pat, True, (30, 40), (2, 3))  # the sinks, whatever the segment
    assert not planning.meets(pat, True, (2, 3), (30, 40))  # but never after the queries
