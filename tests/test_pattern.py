"""DilatedPattern (README, "The pattern"): validation, IO, the rule's three forms agree, pair counting,
and the reference attention against a per-pair evaluation of the rule."""

import math
import random
from pathlib import Path

import pytest
import torch

import helpers
from conftest import attention_tol
from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

CONFIGS = Path(__file__).resolve().parent.parent / "hf_hilbert_attn" / "patterns"


def random_pattern(rng: random.Random, max_w: int = 40) -> DilatedPattern:
    """Either window kind, with or without sink tokens, rates up to 7."""
    return helpers.random_pattern(rng, max_w=max_w, max_rate=7, window=None, sinks=None)


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(segment_lengths=[], dilation_rates=[]), r"segment_lengths must be non-empty, got \[\]"),
        (dict(segment_lengths=[4], dilation_rates=[]), r"dilation_rates must be non-empty, got \[\]"),
        (dict(segment_lengths=[4, 8], dilation_rates=[1]),
         r"must have equal length, got 2 segment_lengths \[4, 8\] and 1 dilation_rates \[1\]"),
        (dict(segment_lengths=[4, 0], dilation_rates=[1, 1]), r"segment_lengths\[1\] must be >= 1, got 0"),
        (dict(segment_lengths=[4, -3], dilation_rates=[1, 1]), r"segment_lengths\[1\] must be >= 1, got -3"),
        (dict(segment_lengths=[4], dilation_rates=[0]), r"dilation_rates\[0\] must be >= 1, got 0"),
        (dict(segment_lengths=[4, 8], dilation_rates=[1, 9]),
         r"dilation_rates\[1\] must be <= segment_lengths\[1\] = 8, got 9"),
        (dict(segment_lengths=[4, 8], dilation_rates=[2, 4]),
         r"dilation_rates must contain a 1 in per_head mode .*got \[2, 4\]"),
        (dict(segment_lengths=[4], dilation_rates=[1], query_dilation="every"),
         r"query_dilation must be one of \('per_head', 'all'\), got 'every'"),
        (dict(segment_lengths=[4], dilation_rates=[1], ordering="morton"),
         r"ordering must be one of \('natural', 'hilbert', 'auto'\), got 'morton'"),
        (dict(segment_lengths=[4.5], dilation_rates=[1]), r"segment_lengths\[0\] must be an integer, got 4.5"),
        (dict(segment_lengths=[4], dilation_rates=["2"]), r"dilation_rates\[0\] must be an integer, got '2'"),
        (dict(segment_lengths=[True], dilation_rates=[1]), r"segment_lengths\[0\] must be an integer, got True"),
        (dict(segment_lengths=[math.inf], dilation_rates=[1]), r"segment_lengths\[0\] must be an integer, got inf"),
        (dict(segment_lengths=4, dilation_rates=[1]), r"segment_lengths must be a non-empty list of integers, got 4"),
        (dict(segment_lengths=[4], dilation_rates=None), r"dilation_rates must be a non-empty list of integers, got None"),
        (dict(segment_lengths=[4], dilation_rates=[1], sink_tokens=-1),
         r"sink_tokens must be an integer >= 0, got -1"),
        (dict(segment_lengths=[4], dilation_rates=[1], sink_tokens=1.5),
         r"sink_tokens must be an integer >= 0, got 1.5"),
        (dict(segment_lengths=[4], dilation_rates=[1], sink_tokens=True),
         r"sink_tokens must be an integer >= 0, got True"),
        (dict(segment_lengths=[4], dilation_rates=[1], window="band"),
         r"window must be one of \('segment', 'sliding'\), got 'band'"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DilatedPattern(**kwargs)


def test_valid_edge_cases():
    # rate == segment length, rates that do not divide, "all" mode without a rate-1 config,
    # integral floats from YAML all pass and normalise to int tuples.
    p = DilatedPattern([5.0, 7], [5, 3], query_dilation="all")
    assert p.segment_lengths == (5, 7) and p.dilation_rates == (5, 3)
    assert all(isinstance(x, int) for x in p.segment_lengths)
    assert DilatedPattern([1], [1]).configs == ((1, 1),)


def test_from_dict_errors():
    with pytest.raises(ValueError, match=r"unknown pattern field\(s\) \['segment'\]"):
        DilatedPattern.from_dict({"segment": [4], "segment_lengths": [4], "dilation_rates": [1]})
    with pytest.raises(ValueError, match="pattern is missing the field 'dilation_rates'"):
        DilatedPattern.from_dict({"segment_lengths": [4]})
    with pytest.raises(ValueError, match="pattern is missing the field 'segment_lengths'"):
        DilatedPattern.from_dict({"dilation_rates": [1]})
    with pytest.raises(ValueError, match="a pattern dict is needed, got list"):
        DilatedPattern.from_dict([[4], [1]])
    # a description is allowed (the shipped YAMLs may carry one), and ignored
    p = DilatedPattern.from_dict({"segment_lengths": [4], "dilation_rates": [1], "description": "x"})
    assert p == DilatedPattern([4], [1])


def test_older_dicts_keep_their_meaning(tmp_path):
    # a YAML / config.json written before sink_tokens and window existed means no sinks and
    # fixed segments, whatever the constructor's defaults are
    old = {"segment_lengths": [8, 32], "dilation_rates": [1, 4], "query_dilation": "per_head",
           "ordering": "natural"}
    p = DilatedPattern.from_dict(old)
    assert (p.sink_tokens, p.window) == (0, "segment")
    path = tmp_path / "old.yaml"
    path.write_text("segment_lengths: [8, 32]\ndilation_rates: [1, 4]\n")
    assert DilatedPattern.from_yaml(path) == p
    new = p.replace(sink_tokens=4, window="sliding")
    assert new.to_dict()["sink_tokens"] == 4 and DilatedPattern.from_dict(new.to_dict()) == new
    assert new != p and hash(new) != hash(p)
    assert "sliding" in str(new) and "sinks=4" in str(new)


def test_count_pairs_many_rates_is_fast(monkeypatch):
    # eight configs with rates 1..128: the per-head classes come from p % lcm(rates), not from a
    # table of every class combination (2^28 entries, minutes): no count table is longer than
    # the lcm (checked by what is asked of bincount, not by a clock)
    import hf_hilbert_attn.counting as counting

    sizes, bincount = [], torch.bincount

    def recording(x, weights=None, minlength=0):
        sizes.append(max(minlength, int(x.max()) + 1 if x.numel() else 0))
        return bincount(x, weights=weights, minlength=minlength)

    monkeypatch.setattr(counting.torch, "bincount", recording)
    p = DilatedPattern([512 * 2**i for i in range(8)], [2**i for i in range(8)],
                       window="sliding", sink_tokens=4)
    n = p.count_pairs(1 << 16, 32)
    assert len(n) == 32 and min(n) > 0
    assert sizes and max(sizes) <= 128, max(sizes)


def test_missing_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="pattern file not found: .*nope.yaml"):
        DilatedPattern.from_yaml(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------------ IO
def test_yaml_round_trip(tmp_path):
    rng = random.Random(torch.initial_seed())
    for n in range(5):
        p = random_pattern(rng).replace(ordering=rng.choice(["natural", "hilbert", "auto"]))
        path = tmp_path / f"p{n}.yaml"
        text = p.to_yaml(path)
        assert path.read_text() == text
        q = DilatedPattern.from_yaml(path)
        assert q == p and hash(q) == hash(p)
        assert q.to_dict() == p.to_dict()
        assert DilatedPattern.from_dict(p.to_dict()) == p


def test_shipped_configs():
    dense = DilatedPattern.from_yaml(CONFIGS / "dense.yaml")
    assert dense.dilation_rates == (1,) and dense.is_dense_for(1 << 20)
    lm = DilatedPattern.from_yaml(CONFIGS / "longnet_lm.yaml")
    assert lm.segment_lengths == (2048, 4096, 8192, 16384, 32768)
    assert lm.dilation_rates == (1, 2, 4, 6, 12)
    assert lm.query_dilation == "per_head"
    pow2 = DilatedPattern.from_yaml(CONFIGS / "pow2.yaml")
    assert all(w & (w - 1) == 0 for w in pow2.segment_lengths)
    assert all(w % r == 0 for w in pow2.segment_lengths for r in pow2.dilation_rates)
    default = DilatedPattern.from_yaml(CONFIGS / "default.yaml")
    assert default.dilation_rates[0] == 1


def test_default_is_dense_up_to_first_window():
    default = DilatedPattern.from_yaml(CONFIGS / "default.yaml")
    w0 = default.segment_lengths[0]
    heads = 2
    for length in (1, 97, w0):
        pos = torch.arange(length)
        mask = default.build_mask(heads, pos, pos, causal=True)
        assert torch.equal(mask[0], torch.ones(length, length, dtype=torch.bool).tril().expand(heads, -1, -1))
        assert default.is_dense_for(length)
    # Past the first window (and the sink tokens, which every query sees) some (head, pair) is
    # no longer allowed: the bound is tight.
    n = w0 + default.sink_tokens + 1
    pos = torch.arange(n)
    mask = default.build_mask(heads, pos, pos, causal=True)
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    assert bool((~mask[0] & tri).any()) and not default.is_dense_for(n)


def test_shipped_defaults_are_measured_choices():
    # docs/decisions.md: sliding windows with one sink token, <= 10 % of the causal pairs at 64K
    for name in ("default", "sliding_sparse"):
        p = DilatedPattern.from_yaml(CONFIGS / f"{name}.yaml")
        assert p.window == "sliding" and p.sink_tokens == 1
        assert p.count_pairs_total(65536, 4) / (4 * 65536 * 65537 / 2) <= 0.10


def test_hash_and_equality():
    a = DilatedPattern([8, 32], [1, 4])
    b = DilatedPattern((8, 32), (1, 4))
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1 and {a: 1}[b] == 1
    assert a != DilatedPattern([8, 32], [1, 4], query_dilation="all")
    assert a != DilatedPattern([8, 32], [1, 2])
    assert a != a.to_dict()
    with pytest.raises(AttributeError):
        a.segment_lengths = (1,)  # frozen


def test_ordering_is_a_layout_not_part_of_the_rule():
    # Equal rules compare equal whatever their storage layout (README "The pattern" and
    # docs/hilbert.md: a layout never changes the function); the layout stays readable and is saved.
    a = DilatedPattern([8, 32], [1, 4], sink_tokens=1)
    for ordering in ("hilbert", "auto"):
        b = DilatedPattern([8, 32], [1, 4], sink_tokens=1, ordering=ordering)
        assert a == b and hash(a) == hash(b) and len({a, b}) == 1
        assert b.ordering == ordering and b.to_dict()["ordering"] == ordering
        assert DilatedPattern.from_dict(b.to_dict()).ordering == ordering
        for causal in (True, False):
            assert b.count_pairs(77, 5, causal=causal) == a.count_pairs(77, 5, causal=causal)
        assert b.attention_flops(77, 5, 16) == a.attention_flops(77, 5, 16)
    # what is derived from a pattern keeps its layout, even where an equal pattern was cached
    d = dict(dense_kv_heads=[0])
    assert DilatedPattern([8, 32], [1, 4], **d).sparse_part.ordering == "natural"
    assert DilatedPattern([8, 32], [1, 4], ordering="hilbert", **d).sparse_part.ordering == "hilbert"


# ------------------------------------------------------------------------------ counting
def test_count_pairs_brute_force():
    rng = random.Random(torch.initial_seed())
    for _ in range(60):
        p = random_pattern(rng)
        length = rng.randint(0, 90)
        heads = rng.randint(1, 9)
        causal = rng.random() < 0.5
        q_len = rng.randint(0, length)
        counts = p.count_pairs(length, heads, causal=causal, q_len=q_len)
        pos = torch.arange(length)
        mask = p.build_mask(heads, pos[length - q_len:], pos, causal=causal)
        brute = mask[0].sum((-1, -2)).tolist() if length else [0] * heads
        assert counts == brute, (p, length, heads, causal, q_len)
        assert p.count_pairs_total(length, heads, causal=causal, q_len=q_len) == sum(brute)


def test_count_pairs_errors():
    p = DilatedPattern([4], [1])
    with pytest.raises(ValueError, match="seq_len must be >= 0, got -1"):
        p.count_pairs(-1, 1)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        p.count_pairs(4, 0)
    with pytest.raises(ValueError, match=r"q_len must be in \[0, seq_len=4\], got 5"):
        p.count_pairs(4, 1, q_len=5)


# ------------------------------------------------------------------------------ rule forms
def _mask_mod_dense(mm, batch, heads, sq, sk):
    """Evaluate a mask_mod on every (b, h, q_idx, kv_idx), one call per pair."""
    out = torch.zeros(batch, heads, sq, sk, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(sq):
                for j in range(sk):
                    out[b, h, i, j] = bool(mm(torch.tensor(b), torch.tensor(h), torch.tensor(i),
                                              torch.tensor(j)))
    return out


def _packed(batch, length, rng):
    """Per-row documents (positions restart per document) with some padding keys (doc id -1)."""
    pos = torch.zeros(batch, length, dtype=torch.int64)
    doc = torch.zeros(batch, length, dtype=torch.int64)
    for b in range(batch):
        i, d = 0, 0
        while i < length:
            n = rng.randint(1, length)
            pos[b, i:i + n] = torch.arange(min(n, length - i))
            doc[b, i:i + n] = d
            i, d = i + n, d + 1
        pad = rng.randint(0, 3)
        doc[b, :pad] = -1
    return pos, doc


def test_mask_mod_equals_build_mask():
    rng = random.Random(torch.initial_seed())
    for n in range(6):
        p = random_pattern(rng, max_w=12)
        causal = n % 2 == 0
        heads, length = rng.randint(1, 4), rng.randint(1, 14)
        # natural positions
        mm = p.mask_mod(causal=causal)
        want = p.build_mask(heads, torch.arange(length), torch.arange(length), causal=causal)
        assert torch.equal(_mask_mod_dense(mm, 1, heads, length, length), want)
        # permuted storage order, per-row packed documents with padding
        pos, doc = _packed(2, length, rng)
        perm = torch.randperm(length)
        pos, doc = pos[:, perm], doc[:, perm]
        mm = p.mask_mod(causal=causal, q_positions=pos, k_positions=pos, q_doc_ids=doc, k_doc_ids=doc)
        want = p.build_mask(heads, pos, pos, causal=causal, q_doc_ids=doc, k_doc_ids=doc)
        assert torch.equal(_mask_mod_dense(mm, 2, heads, length, length), want)
        assert mm.__name__.startswith("dilated_w")


def test_reference_equals_per_pair_softmax():
    rng = random.Random(torch.initial_seed())
    for n in range(4):
        p = random_pattern(rng, max_w=16)
        causal = n % 2 == 0
        b, hq, hkv, d = 2, 4, 2, 8
        sq = rng.randint(1, 9)
        sk = sq + rng.randint(0, 8)
        q = torch.randn(b, hq, sq, d, dtype=torch.float64)
        k = torch.randn(b, hkv, sk, d, dtype=torch.float64)
        v = torch.randn(b, hkv, sk, d, dtype=torch.float64)
        kpos, doc = _packed(b, sk, rng)
        qpos, qdoc = kpos[:, sk - sq:], doc[:, sk - sq:]
        scale = rng.uniform(0.1, 1.0)
        out, lse = reference_attention(q, k, v, p, causal=causal, scale=scale, q_positions=qpos,
                                       k_positions=kpos, q_doc_ids=qdoc, k_doc_ids=doc,
                                       return_lse=True, dtype=torch.float64)
        # mask_mod indexes queries by storage index: give it the query and key tables apart.
        mm = p.mask_mod(causal=causal, q_positions=qpos, k_positions=kpos, q_doc_ids=qdoc, k_doc_ids=doc)
        for bi in range(b):
            for h in range(hq):
                kv = h // (hq // hkv)
                for i in range(sq):
                    keys = [j for j in range(sk) if bool(mm(torch.tensor(bi), torch.tensor(h),
                                                            torch.tensor(i), torch.tensor(j)))]
                    if not keys:
                        assert lse[bi, h, i] == float("-inf")
                        assert torch.equal(out[bi, h, i], torch.zeros(d, dtype=torch.float64))
                        continue
                    logits = torch.stack([scale * torch.dot(q[bi, h, i], k[bi, kv, j]) for j in keys])
                    want_lse = torch.logsumexp(logits, 0)
                    w = torch.exp(logits - want_lse)
                    want = sum(w[n] * v[bi, kv, j] for n, j in enumerate(keys))
                    # float64, both: twice the sums' bound (conftest.attention_tol)
                    tol = 2 * attention_tol(sk, d, torch.float64)
                    torch.testing.assert_close(lse[bi, h, i], want_lse, rtol=tol, atol=tol)
                    torch.testing.assert_close(out[bi, h, i], want, rtol=tol, atol=tol)


def test_allowed_is_union_of_configs():
    rng = random.Random(torch.initial_seed())
    for _ in range(10):
        p = random_pattern(rng)
        h = torch.arange(5).view(5, 1, 1)
        qp = torch.randint(-50, 200, (30, 1))
        kp = torch.randint(-50, 200, (1, 40))
        union = torch.zeros(5, 30, 40, dtype=torch.bool)
        for i in range(p.num_configs):
            union |= p.config_allowed(i, h, qp, kp)
            seg_q, cls_q = p.segment_and_class(i, qp)
            seg_k, cls_k = p.segment_and_class(i, kp)
            # a config allows only pairs of one (segment, class) group
            assert not (p.config_allowed(i, h, qp, kp) & ~((seg_q == seg_k) & (cls_q == cls_k))).any()
        if p.sink_tokens:  # the sink rule joins the union
            union |= p.sink_allowed(kp)
        assert torch.equal(p.allowed(h, qp, kp).expand_as(union), union)


# ------------------------------------------------------------------------------ op inputs
def _qkv(b=1, hq=2, hkv=1, sq=8, sk=8, d=16, dtype=torch.float32):
    return (torch.randn(b, hq, sq, d, dtype=dtype), torch.randn(b, hkv, sk, d, dtype=dtype),
            torch.randn(b, hkv, sk, d, dtype=dtype))


P = DilatedPattern([4, 8], [1, 2])


@pytest.mark.parametrize(
    "make, kwargs, exc, message",
    [
        (lambda: (torch.randn(2, 8, 16),) + _qkv()[1:], {}, ValueError,
         r"q must be 4-D \[B, H, S, D\], got shape \(2, 8, 16\)"),
        (lambda: _qkv()[:1] + (torch.randn(1, 1, 8), _qkv()[2]), {}, ValueError, r"k must be 4-D"),
        (lambda: _qkv()[:2] + (torch.randn(1, 1, 1, 8, 16),), {}, ValueError, r"v must be 4-D"),
        (lambda: tuple(t.to(torch.int32) for t in _qkv()), {}, ValueError,
         r"q must be float16/bfloat16/float32/float64, got torch.int32"),
        (lambda: (_qkv()[0].double(),) + _qkv()[1:], {}, ValueError,
         r"q, k, v must share a dtype, got torch.float64, torch.float32, torch.float32"),
        (lambda: _qkv(hq=3, hkv=2), {}, ValueError,
         r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda: (_qkv(b=2)[0],) + _qkv(b=1)[1:], {}, ValueError,
         "q and k must have the same batch size, got 2 and 1"),
        (lambda: (_qkv(d=8)[0],) + _qkv(d=16)[1:], {}, ValueError,
         "q and k must have the same head_dim, got 8 and 16"),
        (lambda: _qkv()[:2] + (torch.randn(1, 1, 7, 16),), {}, ValueError,
         r"k and v must agree in \[B, H, S\], got \(1, 1, 8, 16\) and \(1, 1, 7, 16\)"),
        (lambda: _qkv(sq=9, sk=8), {}, ValueError, r"without positions, Sq \(9\) must be <= Sk \(8\)"),
        (_qkv, dict(backend="cuda"), ValueError,
         r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
        (_qkv, dict(scale="0.1"), ValueError, "scale must be a finite number or None, got '0.1'"),
        (_qkv, dict(scale=math.inf), ValueError, "scale must be a finite number or None, got inf"),
        (_qkv, dict(q_positions=torch.arange(8.0)), ValueError,
         "q_positions must be an integer tensor, got dtype torch.float32"),
        (_qkv, dict(k_positions=torch.ones(8, dtype=torch.bool)), ValueError,
         "k_positions must be an integer tensor, got dtype torch.bool"),
        (_qkv, dict(q_positions=torch.arange(7)), ValueError,
         r"q_positions must have shape \[8\] or \[1, 8\], got \(1, 7\)"),
        (lambda: _qkv(b=2), dict(k_positions=torch.zeros(3, 8, dtype=torch.int64)), ValueError,
         r"k_positions must have shape \[8\] or \[1 or 2, 8\], got \(3, 8\)"),
        (_qkv, dict(k_positions=torch.zeros(1, 1, 8, dtype=torch.int64)), ValueError,
         r"k_positions must have shape .*got \(1, 1, 8\)"),
        (lambda: _qkv(sq=4), dict(k_positions=torch.arange(8)), ValueError,
         "q_positions is required when k_positions is given and Sq != Sk"),
        (lambda: _qkv(sq=4), dict(q_doc_ids=torch.zeros(4, dtype=torch.int64)), ValueError,
         "q_doc_ids and k_doc_ids must be given together"),
        (_qkv, dict(q_doc_ids=torch.zeros(8), k_doc_ids=torch.zeros(8, dtype=torch.int64)),
         ValueError, "q_doc_ids must be an integer tensor, got dtype torch.float32"),
        (_qkv, dict(q_doc_ids=torch.zeros(8, dtype=torch.int64), k_doc_ids=torch.zeros(2, 8)),
         ValueError, "k_doc_ids must be an integer tensor, got dtype torch.float32"),
    ],
)
@pytest.mark.parametrize("fn", ["dilated", "reference"])
def test_bad_inputs(make, kwargs, exc, message, fn):
    q, k, v = make()
    kw = dict(kwargs)
    backend = kw.pop("backend", "torch")
    if fn == "reference" and backend != "torch":
        pytest.skip("reference_attention has no backend argument")
    with pytest.raises(exc, match=message):
        if fn == "reference":
            reference_attention(q, k, v, P, **kw)
        else:
            dilated_attention(q, k, v, P, backend=backend, **kw)


def test_bad_pattern_and_reference_dtype():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="pattern must be a DilatedPattern, got dict"):
        dilated_attention(q, k, v, P.to_dict())
    with pytest.raises(TypeError, match=r"got str \(hf_hilbert_attn.patterns.as_pattern reads"):
        dilated_attention(q, k, v, "default")  # (a name: the error says what reads one)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        dilated_attention(q, [[1.0]], v, P)
    with pytest.raises(ValueError, match="reference dtype must be float32 or float64, got torch.float16"):
        reference_attention(q, k, v, P, dtype=torch.float16)
