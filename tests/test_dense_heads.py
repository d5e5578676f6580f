"""Dense key/value heads (the rule's dense_kv_heads clause, hf_hilbert_attn/pattern.py): the
rule, its counts, every engine against the reference, the per-layer model configuration, the
bounded cache and the ring.

float64 inputs on the PyTorch path are float64 end to end (the lse is returned as float32, as
the op's contract says), so outputs and gradients agree with the float64 reference to the sums'
bound in float64 (``_attention_tol``: conftest.attention_tol), ~1e-13 relative, far below any
error a wrong pair would make (O(1e-2) and up); float32 through the Triton interpreter to
float32's.
"""

from __future__ import annotations

import random

import pytest
import torch

import hf_hilbert_attn
from hf_hilbert_attn import (DilatedPattern, PatternCache, configure, dilated_attention,
                             reference_attention, set_dense_kv_heads)
from hf_hilbert_attn.integrations.transformers import get_pattern

from _dist import run_distributed
from conftest import RANDN_MAX, attention_tol, lse_float32_tol, model_tol
from helpers import assert_close, random_pattern
from test_transformers import tiny_model, tokens


def _attention_tol(q, k) -> float:
    """Rule 1 for attention (conftest.attention_tol) at these shapes, in ``q``'s dtype: out,
    lse and dQ entries sum over ``sk`` keys; dK/dV entries over the queries of every query head
    sharing the key/value head (``sq * hq / hkv``). Relative to ``max(1, max|want|)``
    (helpers.assert_close)."""
    (hq, sq, d), (hkv, sk) = q.shape[1:], k.shape[1:3]
    return attention_tol(max(sk, sq * hq // hkv), d, q.dtype)


def _dense_pattern(rng: random.Random, hkv: int, **kw) -> DilatedPattern:
    base = random_pattern(rng, max_w=30, min_w=2, max_rate=5, window=None, sinks=None, **kw)
    heads = rng.sample(range(hkv), rng.randint(1, hkv))
    return base.replace(dense_kv_heads=heads)


# ------------------------------------------------------------------------------ the rule
def test_validation_and_serialisation(tmp_path):
    for bad in ([-1], [0, 0], ["a"], 3, None, [1.5]):
        with pytest.raises(ValueError, match="dense_kv_heads"):
            DilatedPattern([8], [1], dense_kv_heads=bad)
    p = DilatedPattern([8, 16], [1, 2], dense_kv_heads=[2, 0])
    assert p.dense_kv_heads == (0, 2)
    assert p == DilatedPattern([8, 16], [1, 2], dense_kv_heads=(0, 2))
    assert p != p.sparse_part and p.sparse_part.dense_kv_heads == ()
    p.to_yaml(tmp_path / "p.yaml")
    assert DilatedPattern.from_yaml(tmp_path / "p.yaml") == p
    # a dict without the field (written before it existed) means no dense heads
    assert "dense_kv_heads" not in p.sparse_part.to_dict()
    assert DilatedPattern.from_dict(p.sparse_part.to_dict()).dense_kv_heads == ()
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"key/value head\(s\) \[2\].*has 2"):
        dilated_attention(q, kv, kv, p)
    with pytest.raises(ValueError, match="num_kv_heads"):
        p.count_pairs(16, 4)


@pytest.mark.parametrize("causal", [True, False])
def test_count_pairs_and_mask_mod_match_the_mask(causal):
    rng = random.Random(torch.initial_seed())
    for _ in range(4):
        hkv = rng.choice([1, 2, 3])
        hq = hkv * rng.choice([1, 2])
        p = _dense_pattern(rng, hkv)
        s, q_len = rng.randint(5, 40), None
        pos = torch.arange(s)
        m = p.build_mask(hq, pos, pos, causal=causal, num_kv_heads=hkv)[0]  # [H, S, S]
        assert p.count_pairs(s, hq, causal=causal, num_kv_heads=hkv) == m.sum((1, 2)).tolist()
        q_len = rng.randint(1, s)
        assert p.count_pairs(s, hq, causal=causal, q_len=q_len, num_kv_heads=hkv) == \
            m[:, s - q_len:].sum((1, 2)).tolist()
        dense = p.dense_query_heads(hq, hkv)
        full = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s).bool()
        assert all(torch.equal(m[h], full) for h in range(hq) if dense[h]), p
        mm = p.mask_mod(causal, num_heads=hq, num_kv_heads=hkv)
        h, qi, ki = torch.meshgrid(torch.arange(hq), pos, pos, indexing="ij")
        assert torch.equal(mm(torch.zeros_like(h), h, qi, ki), m), p


# ------------------------------------------------------------------------ engines vs reference
def _inputs(b, hq, hkv, s, d, dtype=torch.float64, sq=None):
    sq = sq or s
    return [torch.randn(b, h, n, d, dtype=dtype).requires_grad_()
            for h, n in ((hq, sq), (hkv, s), (hkv, s))]


def _compare(p, q, k, v, **kw):
    """Output, lse and gradients against the float64 reference, to the sums' bound at these
    shapes in the inputs' dtype (``_attention_tol``: float64 end to end on the PyTorch path,
    float32 in the Triton interpreter, as on the GPU). A gradient's terms carry dP - delta
    (dot products of randn-sized dO and V) where an output's carry V: up to RANDN_MAX times
    larger (as tests/test_kernels.py). The lse is float32 whatever the inputs: one more
    rounding (conftest.lse_float32_tol)."""
    out, lse = dilated_attention(q, k, v, p, return_lse=True, **kw)
    kw.pop("backend", None)
    ref, ref_lse = reference_attention(q, k, v, p, return_lse=True, dtype=torch.float64, **kw)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v))
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    tol = _attention_tol(q, k)
    assert_close("out", out.detach(), ref.detach(), tol, str(p))
    assert lse.dtype == torch.float32
    assert_close("lse", lse, ref_lse.detach(), tol + lse_float32_tol(), str(p))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(name, g, w, tol * RANDN_MAX, str(p))


def test_torch_path_matches_reference_gqa_docs_padding_positions():
    rng = random.Random(torch.initial_seed())
    for case in range(6):
        hkv = rng.choice([1, 2, 3])
        hq, b, s = hkv * rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([17, 33, 50])
        p = _dense_pattern(rng, hkv)
        q, k, v = _inputs(b, hq, hkv, s, 8)
        kw = dict(causal=rng.random() < 0.7)
        if case % 3 == 1:  # packed documents with restarting positions and a padded tail
            cut = rng.randint(1, s - 2)
            docs = torch.tensor([0] * cut + [1] * (s - cut - 1) + [-1])
            pos = torch.cat([torch.arange(cut), torch.arange(s - cut)])
            kw.update(q_positions=pos, k_positions=pos, q_doc_ids=docs.clamp_min(0), k_doc_ids=docs)
        elif case % 3 == 2:  # any storage order (a Hilbert layout, a ring shard)
            pos = torch.randperm(s)
            kw.update(q_positions=pos, k_positions=pos)
        _compare(p, q, k, v, **kw)
    # decode: the last queries of a longer key row
    p = DilatedPattern([8, 16], [1, 4], sink_tokens=1, dense_kv_heads=[1])
    q, k, v = _inputs(2, 4, 2, 40, 8, sq=3)
    _compare(p, q, k, v)


def test_triton_interpreter_matches_reference():
    # float32 through the kernels in the interpreter (exact arithmetic there, see test_kernels)
    p = DilatedPattern([8, 16], [1, 2], window="sliding", sink_tokens=1, dense_kv_heads=[0])
    q, k, v = _inputs(1, 4, 2, 37, 16, dtype=torch.float32)
    _compare(p, q, k, v, backend="triton")  # float32: 74 query rows per key, head_dim 16


def _planned_heads(items, fields):
    """{config launch: sorted heads its launches cover} of a plan's items (launch rows)."""
    hoff, hch, nl = (fields.index(f) for f in ("HOFF", "HCH", "NLAUNCHED"))
    heads = {}
    for _, row, *_ in items:
        h0, n, li = (int(row[i]) for i in (hoff, hch, nl))
        heads.setdefault(li, []).extend(range(h0, h0 + n))
    return {li: sorted(h) for li, h in heads.items()}


@pytest.mark.parametrize("merge", [False, True], ids=["own", "merging"])
def test_kernels_launch_nothing_for_skipped_heads(merge):
    # the plans of a call that skips key/value head 1 of 3 (2 query heads each), one head per
    # float32 chunk: every other head once per config launch, none of the skipped ones; where
    # the call merges into given sums (a ring piece of a layer with dense heads), trailing head 2
    from hf_hilbert_attn import kernels
    from hf_hilbert_attn.inputs import check_inputs
    from hf_hilbert_attn.kernels import _bwd, _calls, _fwd
    from hf_hilbert_attn.kernels._common import LAUNCH_FIELDS

    p = DilatedPattern([8, 16], [1, 2], sink_tokens=1)
    q, k, v = _inputs(2, 6, 3, 40, 16, dtype=torch.float32)
    a = check_inputs(q, k, v, p)
    plan, _ = kernels.plan_positions(a, p)
    with kernels.configured(acc_bytes=40 * 16 * 4 * 2) as cfg:  # one head (B = 2) per chunk
        shape = (2, 6, 3, 40, 40, 16)
        skipped = (2,) if merge else (1,)
        calls = {skip: _calls.Call(p, plan, shape, torch.float32, q.device, True, cfg, skip,
                                   merge, merge) for skip in ((), skipped)}
        fwd = {skip: _planned_heads(_fwd.plan_fwd(c).items, LAUNCH_FIELDS)
               for skip, c in calls.items()}
        bwd = {skip: _bwd.plan_bwd(c) for skip, c in calls.items()}
    assert len(fwd[()]) > 1  # several config launches (chunked where not merging)
    assert all(h == list(range(6)) for h in fwd[()].values()), fwd[()]
    heads, kv = ([0, 1, 2, 3], [0, 1]) if merge else ([0, 1, 4, 5], [0, 2])
    assert all(h == heads for h in fwd[skipped].values()), fwd[skipped]
    assert all(h == heads for h in _planned_heads(bwd[skipped].dq_items, LAUNCH_FIELDS).values())
    assert all(h == kv for h in _planned_heads(bwd[skipped].kv_items, LAUNCH_FIELDS).values())


@pytest.mark.parametrize("skip_rows", [0, 1 << 20], ids=["skipped", "computed"])
@pytest.mark.parametrize("dense", [[1], [0, 2], [2]])
def test_triton_interpreter_skips_dense_heads_exactly(dense, skip_rows):
    # the sparse call skips the dense heads (chunks around them, one head per chunk), or, on a
    # short call where skipping [1] would split the heads, computes and discards them: outputs,
    # lse and every gradient as the reference's
    from hf_hilbert_attn import kernels

    p = DilatedPattern([8, 16], [1, 2], sink_tokens=1, dense_kv_heads=dense)
    q, k, v = _inputs(1, 6, 3, 29, 16, dtype=torch.float32)
    with kernels.configured(acc_bytes=29 * 16 * 4, skip_rows=skip_rows):
        _compare(p, q, k, v, backend="triton")  # float32: 58 query rows per key, head_dim 16


@pytest.mark.parametrize("layout", ["natural", "permuted", "decode", "documents"])
def test_triton_interpreter_runs_dense_heads_in_one_call(monkeypatch, layout):
    # on the kernels' path the dense heads are launches of the same call (one forward and one
    # backward runner with the whole pattern), not a second call of the op; packed documents
    # (one kernel call per document) still split the call in two
    from hf_hilbert_attn import kernels, ops
    from hf_hilbert_attn.kernels import _bwd, _fwd

    seen, real = [], (kernels.fwd_runner, kernels.bwd_runner)
    for fwd, bwd in ((kernels, kernels), (_fwd, _bwd)):  # (the prepared call's, the launchers')
        monkeypatch.setattr(fwd, "fwd_runner", lambda *a, **k: seen.append(a[2]) or real[0](*a, **k))
        monkeypatch.setattr(bwd, "bwd_runner", lambda *a, **k: seen.append(a[2]) or real[1](*a, **k))
    split, real_split = [], ops._Split.run
    monkeypatch.setattr(ops._Split, "run", lambda *a: split.append(1) or real_split(*a))
    p = DilatedPattern([8, 16], [1, 2], window="sliding", sink_tokens=1, dense_kv_heads=[1])
    q, k, v = _inputs(1, 6, 3, 29, 16, dtype=torch.float32, sq=5 if layout == "decode" else None)
    kw = {}
    if layout == "permuted":
        pos = torch.randperm(29)
        kw = dict(q_positions=pos, k_positions=pos)
    elif layout == "documents":
        docs = torch.tensor([0] * 12 + [1] * 17)
        kw = dict(q_doc_ids=docs, k_doc_ids=docs)
    _compare(p, q, k, v, backend="triton", **kw)
    if layout == "documents":
        assert split and all(not s.dense_kv_heads for s in seen)
    else:
        assert not split and len(seen) == 2 and all(s == p for s in seen)


def test_compiled_calls_carry_dense_heads_to_the_kernels():
    # traced by torch.compile, a call reaches the kernels through the custom ops, whose schema
    # carries the dense heads: the same launches as the eager call, so the same bits (no sink
    # keys: their dk/dv are summed atomically, in any order, on a GPU)
    p = DilatedPattern([8, 16], [1, 2], window="sliding", dense_kv_heads=[0])
    q, k, v = _inputs(1, 6, 3, 29, 16, dtype=torch.float32)
    dout = torch.randn_like(q)

    def f(a, b, c):
        return dilated_attention(a, b, c, p, backend="triton")

    def grads(fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        return [out.detach()] + list(torch.autograd.grad((out * dout).sum(), ins))

    torch._dynamo.reset()
    for name, e, c in zip(("out", "dq", "dk", "dv"), grads(f),
                          grads(torch.compile(f, backend="eager", fullgraph=True))):
        assert torch.equal(e, c), name


def test_short_calls_skip_only_heads_that_save_a_launch():
    from hf_hilbert_attn.kernels import KernelConfig
    from hf_hilbert_attn.kernels._calls import _skipped

    cfg = KernelConfig(skip_rows=4096)
    assert _skipped((1,), 3, 4096, cfg, False) == (1,)  # long enough: the programs saved count
    assert _skipped((1,), 3, 4095, cfg, False) == ()  # would split 0 | 2: computed instead
    assert _skipped((0,), 3, 16, cfg, False) == (0,) and _skipped((0, 2), 3, 16, cfg, False) == (0, 2)
    assert _skipped((), 3, 16, cfg, False) == ()
    # merging into given sums: only trailing heads (launches index the sums from their first head)
    assert _skipped((1,), 3, 1 << 20, cfg, True) == () and _skipped((0,), 3, 16, cfg, True) == ()
    assert _skipped((1, 2), 3, 16, cfg, True) == (1, 2) and _skipped((0, 2), 3, 16, cfg, True) == (2,)


def test_sdpa_serves_calls_the_pattern_makes_dense(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or real(*a, **k))
    p = DilatedPattern([64, 256], [1, 4], sink_tokens=1)
    q, k, v = _inputs(2, 4, 2, 50, 8)
    out = dilated_attention(q, k, v, p)  # 50 <= 64: every pair allowed
    assert len(calls) == 1 and calls[0]["enable_gqa"] and calls[0]["is_causal"]
    # float64 SDPA vs the float64 reference: rows of 50 keys, head_dim 8 in another order
    assert_close("out", out, reference_attention(q, k, v, p, dtype=torch.float64),
                 _attention_tol(q, k))
    q1 = q[:, :, -1:].detach()
    dilated_attention(q1, k, v, p)  # decode: one query, no mask needed
    assert len(calls) == 2 and not calls[1]["is_causal"]
    dilated_attention(q, k, v, p, backend="torch")  # an engine named: no shortcut
    dilated_attention(q, k, v, p, return_lse=True)  # SDPA has no lse
    dilated_attention(*_inputs(1, 4, 2, 80, 8), p)  # not dense at 80
    assert len(calls) == 2
    # dense heads of a sparse pattern take SDPA for their slice
    dilated_attention(*_inputs(1, 4, 2, 80, 8), p.replace(dense_kv_heads=[1]))
    assert len(calls) == 3 and calls[2]["enable_gqa"]
    # where the sparse heads are dense too, one call serves every head
    dq, dk, dv = _inputs(2, 4, 2, 50, 8)
    out = dilated_attention(dq, dk, dv, p.replace(dense_kv_heads=[1]))
    assert len(calls) == 4 and calls[3]["enable_gqa"] and calls[3]["is_causal"]
    assert_close("out", out, reference_attention(dq, dk, dv, p.replace(dense_kv_heads=[1]),
                                                 dtype=torch.float64), _attention_tol(dq, dk))


# ------------------------------------------------------------------------------- the model
SMALL = DilatedPattern([8, 16], [1, 4], window="sliding", sink_tokens=1)


def _assert_logits_close(got, want, n_keys, what=""):
    """Two runs of one tiny float32 model's function through other sums (another attention,
    a reloaded copy, a cache): rule 1 for a model (conftest.model_tol) over attention rows of
    ``n_keys`` keys and the layers' <= 128 features (intermediate 128, hidden 64), relative to
    the logits' largest."""
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= model_tol(n_keys, 128) * scale, f"{what}: max |diff| {err:.3g}, max {scale:.3g}"


def test_per_layer_dense_heads_reach_their_layers_and_round_trip(tmp_path, monkeypatch):
    model = configure(tiny_model("llama"), SMALL)  # 2 layers, 4 query / 2 kv heads
    ids = tokens(2, 45)
    sparse = model(ids).logits
    set_dense_kv_heads(model, [[1], []])
    assert [get_pattern(model.config, i).dense_kv_heads for i in (0, 1)] == [(1,), ()]
    seen = []
    real = hf_hilbert_attn.integrations.transformers.dilated_attention
    monkeypatch.setattr(hf_hilbert_attn.integrations.transformers, "dilated_attention",
                        lambda *a, **k: seen.append(a[3].dense_kv_heads) or real(*a, **k))
    hybrid = model(ids).logits
    assert seen == [(1,), ()]
    # the dense head changes the function: far more than rounding (45 keys per row)
    assert (hybrid - sparse).abs().max() > model_tol(45, 128) * sparse.abs().max()
    model.save_pretrained(tmp_path)
    back = type(model).from_pretrained(tmp_path, attn_implementation="hilbert_dilated").eval()
    assert back.config.hilbert_attn["layer_dense_kv_heads"] == [[1], []]
    _assert_logits_close(back(ids).logits, hybrid, 45, "reloaded")
    # every head dense in every layer is plain attention
    set_dense_kv_heads(model, {0: [0, 1], 1: [0, 1]})
    dense = model(ids).logits
    model.set_attn_implementation("sdpa")
    _assert_logits_close(dense, model(ids).logits, 45, "all heads dense vs sdpa")
    for bad, match in (([[0]], "all 2 layers"), ([[2], []], "layer 0.*head"),
                       ({5: [0]}, "layers \\[5\\]")):
        with pytest.raises(ValueError, match=match):
            set_dense_kv_heads(model, bad)
    # a new pattern keeps the calibration (which heads retrieve), unless told otherwise
    configure(model, "dense")
    assert model.config.hilbert_attn["layer_dense_kv_heads"] == [[0, 1], [0, 1]]
    configure(model, SMALL, keep_dense_heads=False)
    assert "layer_dense_kv_heads" not in model.config.hilbert_attn
    set_dense_kv_heads(model, [[1], []])
    set_dense_kv_heads(model, None)
    assert "layer_dense_kv_heads" not in model.config.hilbert_attn


def test_pattern_cache_keeps_dense_layers_whole_and_matches_full_forward():
    model = configure(tiny_model("llama"), SMALL)
    set_dense_kv_heads(model, [[0], []])
    ids = tokens(1, 60)
    full = model(ids).logits
    cache = PatternCache(model)
    out = model(ids[:, :40], past_key_values=cache, use_cache=True)
    for t in range(40, 60):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        _assert_logits_close(out.logits[:, 0], full[:, t], t + 1, f"decode step {t}")
    assert cache.stored_tokens(0) == 60  # the dense layer keeps every key
    assert cache.stored_tokens(1) <= cache.max_stored_tokens < 60  # the other stays bounded


# -------------------------------------------------------------------------------- the ring
def _ring_case(rank, world, seed):
    from hf_hilbert_attn.ring import ring_attention
    from hf_hilbert_attn.sharding import shard_positions

    g = torch.Generator().manual_seed(seed)
    p = DilatedPattern([6, 20], [1, 3], window="sliding", sink_tokens=1, dense_kv_heads=[1])
    b, hq, hkv, s, d = 1, 4, 2, 48, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g).requires_grad_()
               for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, dtype=torch.float64, generator=g)
    ref = reference_attention(q, k, v, p, dtype=torch.float64)
    want = torch.autograd.grad((ref * dout).sum(), (q, k, v))
    idx = shard_positions(s, world, "zigzag", p)[rank]
    ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, p, group=torch.distributed.group.WORLD, q_positions=idx,
                         k_positions=idx)
    out2 = ring_attention(ql, kl, vl, p, group=torch.distributed.group.WORLD, q_positions=idx,
                          k_positions=idx)  # the next layer: both rings' plans are reused
    tol = _attention_tol(q, k)  # float64 end to end: 48 keys, 96 query rows per key, head_dim 8
    assert_close("out", out.detach(), ref.detach()[:, :, idx], tol)
    torch.testing.assert_close(out2, out, atol=0, rtol=0)
    got = torch.autograd.grad((out * dout[:, :, idx]).sum(), (ql, kl, vl))
    # dk/dv of this shard's keys: the reference's rows (queries of every rank contribute)
    assert_close("dq", got[0], want[0][:, :, idx], tol * RANDN_MAX)
    return [gg.tolist() for gg in got[1:]], idx.tolist()


@pytest.mark.multiprocess
def test_ring_with_dense_heads_matches_reference():
    seed = int(torch.initial_seed()) % (1 << 31)
    res = run_distributed(_ring_case, 2, seed, timeout=240)
    # each rank's dk/dv are its own keys' whole gradients (remote queries' shares sent back)
    g = torch.Generator().manual_seed(seed)
    p = DilatedPattern([6, 20], [1, 3], window="sliding", sink_tokens=1, dense_kv_heads=[1])
    q, k, v = (torch.randn(1, h, 48, 8, dtype=torch.float64, generator=g).requires_grad_()
               for h in (4, 2, 2))
    dout = torch.randn(1, 4, 48, 8, dtype=torch.float64, generator=g)
    want = torch.autograd.grad((reference_attention(q, k, v, p, dtype=torch.float64) * dout).sum(),
                               (k, v))
    tol = _attention_tol(q, k) * RANDN_MAX  # float64 gradients, as in _ring_case
    for (dk, dv), idx in res:
        for name, got, ref in (("dk", dk, want[0]), ("dv", dv, want[1])):
            assert_close(name, torch.tensor(got, dtype=torch.float64), ref[:, :, idx], tol)


def test_a_covered_config_is_accepted_with_a_warning():
    with pytest.warns(UserWarning, match=r"config 1 \(w=16, r=2\) is covered by config 0"):
        DilatedPattern([32, 16], [1, 2])  # decreasing windows: the second adds nothing
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DilatedPattern([32, 16], [2, 1])  # here each config adds pairs
        DilatedPattern([16, 32], [1, 2], window="sliding")
        # per head, an 43-segment of (43, 2) starts in class 1 of (86, 2) every other time
        DilatedPattern([43, 86, 200], [2, 2, 1])


def test_a_config_said_covered_adds_no_pair():
    # the warning's claim, checked on the mask: without the config it names, the same pairs
    import random
    import re
    import warnings

    from helpers import random_pattern

    rng = random.Random(torch.initial_seed())
    said = 0
    for _ in range(300):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            p = random_pattern(rng, 60, nested=True, window=None)
        names = [re.match(r"pattern config (\d+)", str(w.message)) for w in got]
        for m in filter(None, names):
            i = int(m.group(1))
            rest = [c for j, c in enumerate(p.configs) if j != i]
            q = p.replace(segment_lengths=[w for w, _ in rest], dilation_rates=[r for _, r in rest])
            heads, pos = 2 * max(p.dilation_rates), torch.arange(80)
            assert torch.equal(q.build_mask(heads, pos, pos), p.build_mask(heads, pos, pos)), p
            said += 1
    assert said > 0


def test_show_pattern_of_a_model_directory(tmp_path, capsys):
    from hf_hilbert_attn.tools.cli import main

    model = configure(tiny_model("llama"), SMALL)
    set_dense_kv_heads(model, [[1], []])
    model.save_pretrained(tmp_path)
    assert main(["show-pattern", str(tmp_path), "--length", "64"]) == 0
    out = capsys.readouterr().out
    assert "dense key/value heads by layer (layer:[heads]): 0:[1]  (1 of 4)" in out
    # layer 0: query heads 2 and 3 (kv head 1) dense; layer 1 none
    full, per = 64 * 65 // 2, SMALL.count_pairs(64, 4)
    want = (per[0] + per[1] + 2 * full + sum(per)) / (8 * full)
    assert f"{want:.2%} of dense" in out


def test_inference_mode_then_autograd():
    # the head indices are cached per layout: one made under inference_mode must not reach a
    # call that records autograd (inference tensors cannot be saved for backward)
    p = DilatedPattern([8, 16], [1, 2], dense_kv_heads=[0])
    q, k, v = _inputs(1, 4, 2, 40, 8)
    with torch.inference_mode():
        dilated_attention(q.detach(), k.detach(), v.detach(), p)
    _compare(p, q, k, v)
