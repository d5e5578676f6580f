"""Head-sharded (Ulysses) sequence parallelism over gloo processes vs the one-process reference.

The cases and checks are the ring's (``test_ring._check_case``: out, lse and dq/dk/dv of every
rank's rows against the float64 reference, padding, packed documents, every layout), with
heads that split over the group: each rank attends every token for its heads, numbered from
its first head (``_head_base``), so per_head classes and dense key/value heads are those of one
process. The numbering itself is tested without processes.
"""

import random

import pytest
import torch

from _dist import run_distributed
from conftest import attention_tol
from helpers import random_pattern
from hf_hilbert_attn import DilatedPattern, dilated_attention, ulysses_attention
from test_ring import TOL64, _check_case


def _case(seed: int, world: int) -> dict:
    """A random case whose heads split over ``world`` ranks: key/value heads a multiple of the
    ranks or fewer (each then goes to several ranks), 1-3 query heads per key/value head."""
    rng = random.Random(seed)
    pat = random_pattern(rng, max_w=40, min_w=3, max_rate=6, window=None,
                         sinks=rng.choice([0, 1, 3]))
    hkv = rng.choice([1, 2, world, 2 * world])
    hq = hkv * rng.choice([g for g in (1, 2, 3, 4) if hkv * g % world == 0])
    if rng.random() < 0.4:
        pat = pat.replace(dense_kv_heads=sorted(rng.sample(range(hkv), 1)))
    return dict(pattern=pat, s=rng.choice([37, 61]) + world, hq=hq, hkv=hkv, d=8,
                b=rng.choice([1, 2]), causal=rng.random() < 0.7,
                layout=rng.choice(["contiguous", "zigzag", "hilbert"]),
                docs=rng.random() < 0.3, seed=seed, attend=ulysses_attention)


def _worker_cases(rank, world, seeds):
    import torch.distributed as dist

    return [_check_case(rank, world, _case(sd, world), dist.group.WORLD) for sd in seeds]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_reference(world):
    base = random.randrange(10**6)
    seeds = [base + i for i in range(6 if world == 2 else 4)]
    run_distributed(_worker_cases, world, seeds, timeout=240)


def _hybrid_case(seed: int) -> dict:
    """A random case on 4 ranks whose heads split over 2 ranks but not over 4: Ulysses in pairs
    of ranks, a ring across the pairs."""
    import functools

    from hf_hilbert_attn.ring import sequence_parallel_attention

    rng = random.Random(seed)
    c = _case(seed, 4)
    hkv = rng.choice([1, 2])
    c.update(hkv=hkv, hq=rng.choice([2, 6]), attend=functools.partial(
        sequence_parallel_attention, mode="hybrid"))
    if c["pattern"].dense_kv_heads:
        c["pattern"] = c["pattern"].replace(dense_kv_heads=[hkv - 1])
    return c


def _worker_hybrid(rank, world, seeds):
    import torch.distributed as dist

    from hf_hilbert_attn.ring.ulysses import ulysses_size

    cases = [_hybrid_case(sd) for sd in seeds]
    # and fixed ones where the numbering of heads decides classes (the second pair's first
    # head is 1 or 3): computed (contiguous), and sent (zigzag: only the rate-4 segment reaches
    # the other pair's keys)
    for layout, pat, hq, hkv in (
            ("contiguous", DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=1,
                                          dense_kv_heads=[1]), 6, 2),
            ("zigzag", DilatedPattern([4, 32], [1, 4]), 2, 1)):
        cases.append(dict(cases[0], pattern=pat, s=64, hq=hq, hkv=hkv, layout=layout,
                          docs=False, causal=True))
    out = []
    for c in cases:
        assert ulysses_size(world, c["hq"], c["hkv"]) == 2, c
        out.append(_check_case(rank, world, c, dist.group.WORLD))
    return out


@pytest.mark.multiprocess
def test_hybrid_matches_reference():
    base = random.randrange(10**6)
    run_distributed(_worker_hybrid, 4, [base + i for i in range(4)], timeout=240)


def test_hybrid_takes_the_largest_ulysses_group_of_one_node(monkeypatch):
    from hf_hilbert_attn.ring.ulysses import ulysses_size

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ulysses_size(8, 32, 8) == 8  # the heads split over every rank: Ulysses alone
    assert ulysses_size(8, 12, 4) == 4  # 12 heads do not split over 8
    assert ulysses_size(4, 9, 3) == 1  # nor 9 over 2 or 4: the ring alone
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # two nodes of 4 ranks
    assert ulysses_size(8, 32, 8) == 4
    assert ulysses_size(8, 32, 2) == 4  # key/value heads go to 2 ranks each


def _worker_sorted(rank, world):
    """Shards out of position order (zigzag, Hilbert; no padding): attended sorted by position,
    results in shard order."""
    import torch.distributed as dist

    from hf_hilbert_attn.ring import ulysses

    out = []
    for layout in ("zigzag", "hilbert"):
        c = dict(pattern=DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=1), s=64, hq=8,
                 hkv=4, d=8, b=1, causal=True, layout=layout, docs=False, seed=11,
                 attend=ulysses_attention)
        out.append(_check_case(rank, world, c, dist.group.WORLD))
        order = ulysses._GATHERED.get(dist.group.WORLD).plan[4]
        assert order is not None and not torch.equal(order, torch.arange(64)), layout
    return out


@pytest.mark.multiprocess
def test_ulysses_sorts_shards_out_of_order():
    run_distributed(_worker_sorted, 2, timeout=120)


def _worker_triton(rank, world):
    """Through the Triton kernels (interpreter, float32): rank 1 holds query heads 2, 3 whose
    classes under rates 2 and 4 are not those of local heads 0, 1."""
    import torch.distributed as dist

    from hf_hilbert_attn import kernels

    kernels.configure(blocks=(16, 16))
    c = dict(pattern=DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=1), s=44, hq=4, hkv=2,
             d=16, b=1, causal=True, layout="contiguous", docs=False, seed=7,
             dtype=torch.float32, backend="triton", tol=attention_tol(48, 16), grads="both",
             attend=ulysses_attention)
    return _check_case(rank, world, c, dist.group.WORLD)


@pytest.mark.multiprocess
def test_ulysses_through_triton_kernels():
    run_distributed(_worker_triton, 2, timeout=300)


@pytest.mark.parametrize("interpret", [False, True])
def test_head_base_numbers_heads_as_one_process(interpret, monkeypatch):
    # A head shard's call equals the one-process call's rows of those heads, on the PyTorch
    # path (float64) and in the kernels (interpreter, float32); without the numbering the
    # classes differ, so the check can fail.
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dt = torch.float32 if interpret else torch.float64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 70, 16, generator=g, dtype=dt)
    k, v = (torch.randn(1, 4, 70, 16, generator=g, dtype=dt) for _ in range(2))
    tol = TOL64 if dt == torch.float64 else attention_tol(70, 16)
    for pat in (DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=1, window="sliding"),
                DilatedPattern([8, 24], [1, 3], dense_kv_heads=[1, 2])):
        full, lse = dilated_attention(q, k, v, pat, return_lse=True)
        for h0, n in ((2, 2), (4, 4), (6, 2)):
            kv = slice(h0 // 2, (h0 + n) // 2)
            local = pat.replace(dense_kv_heads=[j - kv.start for j in pat.dense_kv_heads
                                                if kv.start <= j < kv.stop])
            args = (q[:, h0:h0 + n], k[:, kv], v[:, kv], local)
            out, lse_l = dilated_attention(*args, return_lse=True, _head_base=h0)
            torch.testing.assert_close(out, full[:, h0:h0 + n], atol=tol, rtol=0)
            torch.testing.assert_close(lse_l, lse[:, h0:h0 + n], atol=tol, rtol=0)
            if h0 % 4 and not pat.dense_kv_heads:  # numbered from 0 instead: another function
                assert not torch.allclose(dilated_attention(*args), out, atol=1e-3)


def _worker_refusals(rank, world):
    import torch.distributed as dist

    from hf_hilbert_attn.ring import sequence_parallel

    q = torch.randn(1, 3, 8, 8)
    pos = torch.arange(8) + 8 * rank
    with pytest.raises(ValueError, match="3 query and 3 key/value heads do not split over 2"):
        ulysses_attention(q, q, q, DilatedPattern([4], [1]), group=dist.group.WORLD,
                          q_positions=pos, k_positions=pos)
    with pytest.raises(ValueError, match="mode must be one of"):
        with sequence_parallel(dist.group.WORLD, mode="heads"):
            pass
    return True


@pytest.mark.multiprocess
def test_ulysses_refuses_heads_that_do_not_split():
    run_distributed(_worker_refusals, 2, timeout=90)


def test_auto_takes_ulysses_where_heads_split_evenly():
    from hf_hilbert_attn.ring.ulysses import resolve_mode

    pat = DilatedPattern([8, 16], [1, 2])
    assert resolve_mode("auto", 4, 32, 8, pat) == "ulysses"
    assert resolve_mode("auto", 4, 32, 2, pat) == "ulysses"  # key/value heads go to 2 ranks
    assert resolve_mode("auto", 2, 9, 3, pat) == "ring"  # 9 heads do not split over 2
    # dense key/value heads: Ulysses only where every rank holds as many (2 per rank of 8)
    assert resolve_mode("auto", 4, 32, 8, pat.replace(dense_kv_heads=[0])) == "ring"
    assert resolve_mode("auto", 4, 32, 8, pat.replace(dense_kv_heads=[0, 2, 5, 7])) == "ulysses"
    assert resolve_mode("auto", 4, 8, 2, pat.replace(dense_kv_heads=[1])) == "ring"
    assert resolve_mode("ring", 4, 32, 8, pat) == "ring"
