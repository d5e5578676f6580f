"""The Triton kernels against ``reference_attention`` (CPU: through the Triton interpreter).

Tiny shapes and 16×16 tiles (``kernels.configure(blocks=...)``) so every tile kind appears: causal
diagonal, union-covered (skipped) and union-boundary tiles, partial segments, range ends.
Float32 inputs: the interpreter computes in float32 like the GPU, so tolerances are the sums'
bound (``conftest.attention_tol``).
"""

import pytest
import torch
import triton
import triton.language as tl

from conftest import RANDN_MAX, attention_tol, eps
from helpers import assert_close
from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn import kernels
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.kernels import _bwd, _calls, plan_positions
from hf_hilbert_attn.kernels._common import (_SCALARS, LAUNCH_FIELDS, LAUNCH_ROW, _covered,
                                             _launch_order, _launch_scalars, _launch_sinks,
                                             _tanh)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _small_tiles():
    old = kernels.configure(blocks=(16, 16))
    yield
    kernels.configure(old)


def _run(pattern, *, b=1, hq=4, hkv=2, sq=37, sk=None, d=16, causal=True, dtype=torch.float32,
         use_lse=True, **kw):
    sk = sk or sq
    q = torch.randn(b, hq, sq, d, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, sk, d, device=DEV, dtype=dtype, requires_grad=True)
    out, lse = dilated_attention(q, k, v, pattern, causal=causal, return_lse=True,
                                 backend="triton", **kw)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if use_lse else None
    finite = torch.isfinite(lse)

    def loss(o, l):
        total = (o.float() * dout.float()).sum()
        if use_lse:
            total = total + torch.where(finite, l * dlse, torch.zeros_like(l)).sum()
        return total

    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(qf, kf, vf, pattern, causal=causal, return_lse=True,
                                       dtype=torch.float64, **kw)
    ref_grads = torch.autograd.grad(loss(ref, ref_lse), (qf, kf, vf))
    # float32: the sums' bound (conftest.attention_tol: the kernels add in tile order). Half:
    # the kernels accumulate in float32, so what is left is rounding the result, and what the
    # backward reads of it, to the input dtype: a few of its eps each, 20 in all.
    tol = attention_tol(max(sq, sk), d) if dtype == torch.float32 else 20 * eps(dtype)
    _close("out", out, ref, tol)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    _close("lse", lse[finite], ref_lse[finite], tol)
    assert torch.all(out[~finite] == 0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        # a gradient's terms carry dP - delta (dot products of randn-sized dO and V) where an
        # output's carry V: up to RANDN_MAX times larger
        _close(name, g, r, tol * RANDN_MAX)


def _close(name, got, ref, tol):
    assert_close(name, got, ref, tol, elementwise=True)


PAT = DilatedPattern([8, 16, 32], [1, 2, 4])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_modes_odd_length_gqa(causal, mode):
    _run(PAT.replace(query_dilation=mode), sq=53, hq=4, hkv=2, causal=causal)


def test_rates_not_dividing_segments():
    # w % r != 0 and r_j not dividing r_i: class offsets move between segments, union masks
    # are per pair on many tiles.
    _run(DilatedPattern([12, 20, 45], [1, 3, 4]), sq=97, hq=6, hkv=3)


def test_all_mode_without_rate_one_noncausal():
    _run(DilatedPattern([10, 24], [2, 3], query_dilation="all"), sq=61, causal=False, hq=2, hkv=1)


def test_dense_pattern_and_mqa():
    _run(DilatedPattern.dense(64), sq=41, hq=4, hkv=1)


def test_decode_and_chunked_queries():
    # queries are the last positions (Sq < Sk): decode and a chunk of prefill
    _run(PAT, sq=1, sk=75, use_lse=False)
    _run(PAT, sq=19, sk=75)


def test_fp16_and_batch():
    _run(PAT, b=2, sq=45, dtype=torch.float16)


def test_hilbert_like_position_map():
    # positions stored in an arbitrary order: the kernels read through inv[pos]
    s = 61
    perm = torch.randperm(s, device=DEV)
    _run(PAT, sq=s, k_positions=perm)


def test_ring_shard_positions_and_batch_maps():
    # queries are one shard (positions with gaps), keys a larger set; per-batch maps
    sk = 48
    kp = torch.stack([torch.randperm(sk, device=DEV), torch.randperm(sk, device=DEV)])
    qp = kp[:, 20:34]
    _run(PAT, b=2, sq=14, sk=sk, q_positions=qp, k_positions=kp)


def test_padding_doc_ids():
    s = 40
    doc = torch.tensor([0] * 15 + [1] * 20 + [-1] * 5, device=DEV)
    _run(PAT, sq=s, q_doc_ids=doc, k_doc_ids=doc)


@pytest.mark.parametrize("causal", [True, False])
def test_consecutive_positions_at_offsets(causal):
    # queries and keys each at consecutive positions from their own start (a ring shard's
    # runs): natural plans with query and key offsets, positions relative to a base that is a
    # multiple of every segment length (here 96 = lcm(8, 16, 32)·3 below the smallest position)
    pat = DilatedPattern([8, 16, 32], [1, 2, 4])
    for qa, ka, sq, sk in ((101, 70, 37, 50), (64, 64, 29, 29), (96, 130, 41, 23)):
        qp, kp = torch.arange(qa, qa + sq, device=DEV), torch.arange(ka, ka + sk, device=DEV)
        q = torch.zeros(1, 4, sq, 16, device=DEV)
        k = torch.zeros(1, 2, sk, 16, device=DEV)
        plan, _ = plan_positions(check_inputs(q, k, k, pat, q_positions=qp, k_positions=kp), pat)
        assert not plan.mapped and plan.base == min(qa, ka) // 32 * 32
        assert (plan.qoff, plan.koff) == (qa - plan.base, ka - plan.base)
        _run(pat, sq=sq, sk=sk, hq=2, hkv=1, causal=causal, q_positions=qp, k_positions=kp)


@triton.jit
def _tanh_rows(x, y, N: tl.constexpr):
    o = tl.program_id(0) * N + tl.arange(0, N)
    tl.store(y + o, _tanh(tl.load(x + o)))


def test_tanh_to_a_few_ulp():
    # the soft-cap's tanh: the series below 0.3 (where the exp form would lose digits), the exp
    # form above. Bound: exp2 within 2 ulp (a GPU's approximation; the interpreter's is exact)
    # moves (1 - e) / (1 + e), e = exp(-2|x|) <= 0.55, by 2·eps·e·(1/(1 - e) + 1/(1 + e)) <=
    # 3.2 eps, and its three roundings add 1.5 eps: 6 eps with margin
    x = torch.cat([torch.linspace(-12, 12, 3 * 1024), torch.randn(1024) * 1e-3,
                   torch.tensor([0.3, -0.3, 0.29999, 0.30001, 1e-30, 50.0, -50.0, 0.0])])
    x = torch.cat([x, x.new_zeros(-x.numel() % 1024)]).to(DEV)
    y = torch.empty_like(x)
    _tanh_rows[(x.numel() // 1024,)](x, y, N=1024)
    want = torch.tanh(x.double())
    rel = (y.double() - want).abs() / want.abs().clamp_min(torch.finfo(torch.float64).tiny)
    assert float(rel.max()) <= 6 * eps(), float(x[rel.argmax()])


@pytest.mark.parametrize("pattern,causal", [
    (DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=2), True),  # union launches, sinks
    (DilatedPattern([8, 16], [1, 2], window="sliding", query_dilation="all"), False),
    (DilatedPattern([12, 20], [1, 3], dense_kv_heads=[1]), True)])  # the dense heads' launch
def test_soft_capped_scores(pattern, causal):
    # Gemma 2's cap * tanh(s / cap) in every launch kind, forward and backward, with padding;
    # a cap of 1.5 moves these inputs' scores by several units (tanh's series below 0.3 and its
    # exp form above both appear)
    doc = torch.tensor([0] * 20 + [1] * 20 + [-1] * 5, device=DEV)
    _run(pattern, sq=45, causal=causal, softcap=1.5, q_doc_ids=doc, k_doc_ids=doc)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,sinks", [("segment", 0), ("sliding", 0), ("segment", 2)])
def test_pieces_launch_only_the_configs_that_join(window, sinks, causal):
    # a zigzag ring piece: queries in a later chunk than their keys. Only the config whose
    # segment (window) reaches across launches; the one covering every query (rate 1) still
    # runs, writes the result and takes the sink keys
    pat = DilatedPattern([8, 16, 128], [1, 2, 4], window=window, sink_tokens=sinks)
    ka = 0 if sinks else 32
    qp, kp = torch.arange(96, 128, device=DEV), torch.arange(ka, ka + 32, device=DEV)
    q = torch.zeros(1, 2, 32, 16, device=DEV)
    plan, _ = plan_positions(check_inputs(q, q, q, pat, q_positions=qp, k_positions=kp), pat)
    _, launch, n_sinks = _calls._launches(pat, plan, causal)
    assert [ln.entry for ln in launch] == [(128, 4), (8, 1)] and n_sinks == sinks
    # a piece that every config reaches launches all three
    plan, _ = plan_positions(check_inputs(q, q, q, pat, q_positions=qp, k_positions=qp), pat)
    assert len(_calls._launches(pat, plan, causal)[1]) == 3
    _run(pat, sq=32, sk=32, hq=2, hkv=1, causal=causal, q_positions=qp, k_positions=kp)


def test_mapped_positions_far_from_zero():
    # a shuffled shard at positions 4096.. : the position table covers only the positions in
    # use (relative to the base); before, 4096 positions of table for 40 tokens were refused
    pat = DilatedPattern([8, 16, 32], [1, 2, 4])
    g = torch.Generator().manual_seed(0)
    pos = (4096 + torch.randperm(40, generator=g)).to(DEV)
    q = torch.zeros(1, 4, 40, 16, device=DEV)
    plan, why = plan_positions(check_inputs(q, q, q, pat, k_positions=pos), pat)
    assert plan is not None and plan.mapped and plan.base == 4096, why
    assert plan.kinv.shape[-1] == 40
    _run(pat, sq=40, k_positions=pos)


def test_packed_documents_run_per_document(monkeypatch):
    # positions restart per document: no single position map, so the op calls the kernels once
    # per document. Row 0: docs of 15 and 25 tokens; row 1: a continuation chunk starting at
    # position 30 (consecutive positions from 30: natural loads with an offset), a 12-token
    # doc, then padding.
    from hf_hilbert_attn import backends

    s = 40
    pos = torch.stack([torch.cat([torch.arange(15), torch.arange(25)]),
                       torch.cat([torch.arange(30, 53), torch.arange(12), torch.arange(5)])]).to(DEV)
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 23 + [1] * 12 + [-1] * 5], device=DEV)
    q = torch.randn(2, 2, s, 16, device=DEV)
    a = check_inputs(q, q, q, PAT, k_positions=pos, k_doc_ids=doc)
    plan, why = plan_positions(a)
    assert plan is None and "repeats" in why
    runs = backends.document_runs(q, q, q, PAT, a)
    assert [(b, lo, hi, p.mapped) for b, lo, hi, p in runs] == [
        (0, 0, 15, False), (0, 15, 40, False), (1, 0, 23, False), (1, 23, 35, False)]
    calls = []
    real = backends.document_runs
    monkeypatch.setattr(backends, "document_runs", lambda *x: calls.append(1) or real(*x))
    _run(PAT, b=2, sq=s, hq=2, hkv=1, k_positions=pos, k_doc_ids=doc)
    assert len(calls) == 2  # forward and backward took the per-document path


def test_packed_document_split_in_two_falls_back():
    # document 0 appears in two storage ranges: per-document calls would miss the pairs
    # between them, so the op runs the PyTorch path
    from hf_hilbert_attn import backends

    s = 30
    pos = torch.cat([torch.arange(10), torch.arange(10), torch.arange(10, 20)]).to(DEV)
    doc = torch.tensor([0] * 10 + [1] * 10 + [0] * 10, device=DEV)
    q = torch.randn(1, 2, s, 16, device=DEV)
    a = check_inputs(q, q, q, PAT, k_positions=pos, k_doc_ids=doc)
    assert backends.document_runs(q, q, q, PAT, a) is None
    backends.reset_fallback_warnings()
    with pytest.warns(RuntimeWarning, match="runs on the PyTorch path") as rec:
        _run(PAT, sq=s, hq=2, hkv=1, k_positions=pos, k_doc_ids=doc)
        _run(PAT, sq=s, hq=2, hkv=1, k_positions=pos, k_doc_ids=doc)
    assert "repeats" in str(rec[0].message)
    assert len([w for w in rec if "PyTorch path" in str(w.message)]) == 1  # once per reason


@pytest.mark.parametrize("pattern", [PAT, DilatedPattern([8, 16], [1, 2], window="sliding",
                                                        sink_tokens=2)], ids=["segment", "sliding"])
def test_head_dim_256(pattern):
    # Gemma's head size on the kernels (a GPU gives it tiles of its own: _plan.fwd_blocks)
    _run(pattern, sq=29, hq=2, hkv=1, d=256)


def test_triton_backend_rejects_unsupported_head_dim():
    q = torch.randn(1, 2, 8, 24, device=DEV)
    with pytest.raises(ValueError, match="head_dim in"):
        dilated_attention(q, q, q, PAT, backend="triton")


def test_forward_head_chunks(monkeypatch):
    # a tiny float32 merge buffer forces one launch sequence per head (long forward-only runs)
    with kernels.configured(acc_bytes=1):
        _run(PAT, sq=29, hq=4, hkv=2)


def test_many_configs_loop_union():
    # more than four earlier configs: the in-kernel union loop instead of the key tables
    # (every config has a partial last segment; 4 query heads on 2 kv heads)
    _run(DilatedPattern([4, 8, 12, 16, 24, 32], [1, 2, 3, 4, 6, 8]), sq=45, hq=4, hkv=2)


def test_backward_buffer_in_head_chunks(monkeypatch):
    # the float32 buffer summing dq over configs holds a chunk of heads when the whole would
    # exceed ACC_BYTES (as in the forward): force chunks of 1 and of 3 of 4 heads
    for acc_bytes in (1, 3 * 37 * 16 * 4):
        with kernels.configured(acc_bytes=acc_bytes):
            _run(PAT, sq=37, hq=4, hkv=2)


def test_backward_sums_share_one_workspace(monkeypatch):
    # dk/dv's float32 sums reuse the memory of dq's (every dq launch precedes the dk/dv ones):
    # one allocation of the larger size, dk's rows at its start (over dq's), dv's after them
    for hch, kch, sq, sk in ((4, 2, 37, 37), (1, 4, 5, 40), (8, 8, 16, 16)):
        dq, dk, dv = _bwd._sum_buffers(2, hch, kch, sq, sk, 16, DEV)
        assert dq.shape == (2, hch, sq, 16) and dk.shape == dv.shape == (2, kch, sk, 16)
        assert dq.data_ptr() == dk.data_ptr()
        assert dv.data_ptr() == dk.data_ptr() + dk.numel() * 4
        assert dq.untyped_storage().nbytes() == 4 * max(dq.numel(), 2 * dk.numel())
    # and the chunked backward stays exact with the shared workspace: the sums of a chunk of
    # heads smaller than the whole (dk / dv in chunks of 1 of 2 key/value heads)
    with kernels.configured(acc_bytes=2 * 37 * 16 * 4):
        _run(PAT, sq=37, hq=4, hkv=2)


@pytest.mark.parametrize("hq, hkv", [(2, 2), (6, 2), (4, 1)])
def test_dkdv_programs_only_for_the_classes_a_group_reads(hq, hkv):
    # per_head: a key/value head's dk/dv programs cover only the classes its query heads read,
    # min(rate, group) of them (from its first head's on, wrapping); the rows of the others are
    # neither read nor written by that launch, and the sink keys' sums come in with a launch
    # that has a program for every key: the first where it has one, else the last. MHA: at
    # rates 4 and 8 three of a head's classes hold no sink key; three heads a group at rate 4:
    # classes that wrap (a head shard's first head: test_ulysses.py)
    pat = DilatedPattern([8, 16, 32], [1, 4, 8], sink_tokens=2, window="sliding")
    sq, group = 45, hq // hkv
    q = torch.zeros(1, hq, sq, 16, device=DEV)
    plan, _ = plan_positions(check_inputs(q, q[:, :hkv], q[:, :hkv], pat), pat)
    c = _calls.Call(pat, plan, (1, hq, hkv, sq, sq, 16), torch.float32, q.device, True,
                    kernels.kernel_config())
    launch = _calls._launches(pat, plan, True)[1]
    items = _bwd.plan_bwd(c).kv_items
    rows = [(grid[0], dict(zip(LAUNCH_FIELDS, row.tolist()))) for grid, row, _, _ in items]
    assert [r["NCLS"] for _, r in rows] == [min(ln.r, group) for ln in launch]
    assert all(n == r["NCLS"] * r["NBLK"] for n, r in rows)  # (one segment: sliding)
    sink_at = 0 if group >= launch[0].r else len(launch) - 1
    assert [kw["F"].SINK for *_, kw in items] == [i == sink_at for i in range(len(launch))]
    _run(pat, sq=sq, hq=hq, hkv=hkv)


def test_write_into_views_of_longer_tensors():
    # the launchers write out/lse and dq/dk/dv into given views (rows of a longer sequence, as
    # ring pieces do) and read inputs through such views, without copies
    from hf_hilbert_attn.kernels import dilated_bwd, dilated_fwd

    pat = DilatedPattern([8, 16, 32], [1, 2, 4])
    big = {n: torch.randn(1, h, 90, 16, device=DEV) for n, h in (("q", 4), ("k", 2), ("v", 2),
                                                                   ("do", 4))}
    rows = slice(20, 61)
    q, k, v, do = (big[n][:, :, rows] for n in ("q", "k", "v", "do"))
    pos = torch.arange(20, 61, device=DEV)
    a = check_inputs(q, k, v, pat, q_positions=pos, k_positions=pos)
    plan, _ = plan_positions(a, pat)
    ref_out, ref_lse = dilated_fwd(q.contiguous(), k.contiguous(), v.contiguous(), pat, a.scale,
                                   True, plan)
    out_big = torch.full((1, 4, 90, 16), float("nan"), device=DEV)
    lse_big = torch.full((1, 4, 90), float("nan"), device=DEV)
    out, lse = dilated_fwd(q, k, v, pat, a.scale, True, plan, out=out_big[:, :, rows],
                           lse=lse_big[:, :, rows])
    assert out.data_ptr() == out_big[:, :, rows].data_ptr()
    # the same launches on the same values; where a GPU adds partial sums in another order,
    # each run is within the sums' bound of the exact result (twice that between them)
    tol = 2 * attention_tol(41, 16)
    _close("out", out_big[:, :, rows], ref_out, tol)
    _close("lse", lse_big[:, :, rows], ref_lse, tol)
    assert torch.isnan(out_big[:, :, :20]).all() and torch.isnan(out_big[:, :, 61:]).all()
    ref = dilated_bwd(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), ref_out,
                      ref_lse, None, pat, a.scale, True, plan)
    grads = [torch.full_like(big[n], float("nan")) for n in ("q", "k", "v")]
    got = dilated_bwd(do, q, k, v, out_big[:, :, rows], lse_big[:, :, rows], None, pat, a.scale,
                      True, plan, *(g[:, :, rows] for g in grads))
    for name, g, r, full in zip(("dq", "dk", "dv"), got, ref, grads):
        _close(name, g, r, tol * RANDN_MAX)
        assert torch.isnan(full[:, :, :20]).all() and torch.isnan(full[:, :, 61:]).all()
    with pytest.raises(ValueError, match="dq must be"):
        dilated_bwd(do, q, k, v, ref_out, ref_lse, None, pat, a.scale, True, plan,
                    dq=torch.empty(1, 4, 41, 8, device=DEV))


def test_may_mix_is_never_wrong():
    # _calls._may_mix == False compiles a launch without the per-pair union code: no program
    # of it may then be one that _covered marks for the mask (an earlier rate not dividing r,
    # or the program's positions straddling an earlier config's segment). Brute force over
    # every program tile of random segment patterns.
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        n = int(torch.randint(2, 5, (1,), generator=g))
        ws = sorted({16 * int(x) for x in torch.randint(1, 33, (n,), generator=g)})
        rs = sorted({int(x) for x in torch.randint(1, 9, (len(ws),), generator=g)})[:len(ws)]
        cfgs = list(zip(ws[:len(rs)], rs))
        tile = (16, 32, 64)[int(torch.randint(0, 3, (1,), generator=g))]
        for i in range(1, len(cfgs)):
            (w, r), earlier = cfgs[i], cfgs[:i]
            predicted = _calls._may_mix(earlier, w, r, tile, False)
            actual = False
            for seg in range(3):
                for c in range(r):
                    ncl = (w - c + r - 1) // r
                    for n0 in range(0, ncl, tile):
                        p0 = seg * w + c + r * n0
                        p1 = seg * w + c + r * (min(n0 + tile, ncl) - 1)
                        actual |= any(r % rj or p0 // wj != p1 // wj for wj, rj in earlier)
            assert predicted or not actual, (cfgs, i, tile)
            seen.add((predicted, actual))
    assert {(False, False), (True, True), (True, False)} <= seen
    assert _calls._may_mix([(4096, 1)], 4096, 2, 64, True)  # sliding: the window's edges


@triton.jit
def _covered_probe(OUT, CFG, p0, p1, sbase, R, h, empty_at, NPRI, PER_HEAD: tl.constexpr):
    ca, cb, ma, mb = _covered(p0, p1, sbase, R, h, empty_at, CFG, NPRI, PER_HEAD=PER_HEAD,
                              SLIDING=False, CAUSAL=True, KSIDE=False)
    tl.store(OUT, ca)
    tl.store(OUT + 1, cb)
    tl.store(OUT + 2, ma)
    tl.store(OUT + 3, mb)


def test_covered_ranges_against_brute_force():
    # _covered (segments): the other side's class indices [ca, cb) it skips must be covered by
    # an earlier config for every position of the tile, and outside [ca, cb) and [ma, mb) (the
    # range where the kernels apply the per-pair union mask) no earlier config may cover a
    # pair: [ma, mb) spans only the segments of a config that hold a position of the tile, two
    # when the tile straddles a boundary. Random patterns, tiles and heads, both modes.
    g = torch.Generator().manual_seed(1)

    def rnd(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))
    out = torch.zeros(4, dtype=torch.int32, device=DEV)
    straddled = 0
    for case in range(120):
        n = rnd(1, 4)
        earlier = [(rnd(1, 9) * 8, rnd(1, 5)) for _ in range(n)]
        w, r = rnd(4, 13) * 16, rnd(1, 7)
        per_head = case % 2 == 0
        h = rnd(0, 12)
        seg, c = rnd(0, 3), (h % r if per_head else rnd(0, r))
        sbase, ncl = seg * w + c, (w - c + r - 1) // r
        n0 = rnd(0, ncl)
        n1 = min(ncl - 1, n0 + rnd(0, 24))
        p0, p1 = sbase + r * n0, sbase + r * n1
        cfg = torch.tensor([x for wr in earlier for x in wr], dtype=torch.int32, device=DEV)
        _covered_probe[(1,)](out, cfg, p0, p1, sbase, r, h, ncl, n, PER_HEAD=per_head)
        ca, cb, ma, mb = out.tolist()

        def covers(q, k):
            return any(q // wj == k // wj and (q % wj) % rj == (k % wj) % rj
                       and (not per_head or (q % wj) % rj == h % rj) for wj, rj in earlier)
        rows = [sbase + r * m for m in range(n0, n1 + 1)]
        for m in range(ncl):
            k = sbase + r * m
            if ca <= m < cb:
                assert all(covers(q, k) for q in rows), (earlier, w, r, h, p0, p1, m)
            elif not ma <= m < mb:
                assert not any(covers(q, k) for q in rows), (earlier, w, r, h, p0, p1, m)
        straddled += any(p0 // wj != p1 // wj for wj, _ in earlier) and mb - ma < ncl
    assert straddled >= 5  # tiles across a boundary, with a range narrower than the segment


def test_kernel_parameters_stay_few():
    # every jit function of the kernels takes at most 26 parameters: tensors as Strided tuples,
    # the launch's integers in its table row, the compile-time flags in one Flags tuple
    import ast
    import pathlib

    found = {}
    for path in pathlib.Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                found[node.name] = len(node.args.args)
    assert {"_fwd_kernel", "_dq_kernel", "_dkdv_kernel"} <= found.keys()
    assert max(found.values()) <= 26, sorted(found.items(), key=lambda kv: -kv[1])[:5]


@triton.jit
def _launch_probe(L, OUT):
    vals = _launch_scalars(L) + _launch_sinks(L) + _launch_order(L)
    for i in tl.static_range(len(vals)):
        tl.store(OUT + i, vals[i])


def test_launch_rows_match_what_the_kernels_read():
    # The host writes each launch's integers by name (LAUNCH_FIELDS); the kernels read them by
    # position (_launch_scalars, _launch_sinks, _launch_order) and name them where they unpack
    # them. Both must agree, field for field, in every kernel; the integers passed as
    # arguments (_SCALARS) are named alike in every kernel's signature.
    import inspect
    import re

    from hf_hilbert_attn.kernels import _dkdv, _fwd

    row = torch.arange(LAUNCH_ROW, dtype=torch.int32, device=DEV) * 7
    out = torch.full((LAUNCH_ROW,), -1, dtype=torch.int32, device=DEV)
    _launch_probe[(1,)](row, out)
    read = out.tolist()[:len(LAUNCH_FIELDS)]
    assert read == [7 * i for i in range(len(LAUNCH_FIELDS))]  # every field once, in order
    for fn in (_fwd._fwd_kernel, _bwd._dq_kernel, _dkdv._dkdv_kernel):
        src = inspect.getsource(getattr(fn, "fn", fn))
        names = []
        for group in (r"_launch_scalars\(L\)", r"_launch_sinks\(L\)", r"_launch_order\(L\)"):
            m = re.search(r"^\s*([A-Z0-9_, ]+) = %s$" % group, src, re.M)
            assert m, (fn, group)
            names += [n.strip() for n in m.group(1).split(",")]
        assert tuple(names) == LAUNCH_FIELDS, (fn, names)
        params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
        i = params.index("L")
        assert params[i + 1:i + 1 + len(_SCALARS)] == _SCALARS, (fn, params)


def test_union_launches_with_and_without_mixed_programs():
    # rates dividing each other, segments multiples of the tiles: the union launches compile
    # without the per-pair code (MIXED False; forward, dq and dk/dv); a rate not dividing the
    # next needs it. Both kinds checked against the reference.
    from hf_hilbert_attn.tools import aot

    pat = DilatedPattern([64, 128, 256, 384], [1, 2, 4, 6])
    q = torch.randn(1, 2, 300, 16)
    calls = aot.launches(q, q[:, :1], q[:, :1], pat)
    union = {(fn.fn.__name__, kw["F"].MIXED) for fn, _g, _a, kw in calls
             if "F" in kw and kw["F"].EARLIER}
    assert union == {(n, m) for n in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel")
                     for m in (False, True)}
    _run(pat, sq=300, hq=2, hkv=1)
    _run(pat.replace(query_dilation="per_head"), sq=300, hq=4, hkv=2, causal=False)


@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_non_dividing_rates_long_segments(mode):
    # like longnet_lm's (8192, 4) before (16384, 6): a query tile of the rate-6 config lies in
    # one segment of the rate-4 config, whose pairs it can cover only pair by pair, and only
    # inside that segment: the per-pair union mask on just those tiles (forward and backward).
    # 200 tokens: a rate-6 tile (16 rows = 96 positions) inside segment 0 of the rate-4 config,
    # one crossing position 128, and a partial one at the range end inside segment 1.
    # per_head: 3 query heads on 1 kv head, classes 0-2 of each rate; all: every head runs every
    # class, so 2 query heads on it are the same launches (flags, tiles) as 3 (the interpreter's
    # time).
    hq = 3 if mode == "per_head" else 2
    _run(DilatedPattern([8, 128, 512], [1, 4, 6], query_dilation=mode), sq=200, hq=hq, hkv=1)


# ------------------------------------------------------------- sink tokens, sliding windows
@pytest.mark.parametrize("window,sinks,causal", [("segment", 3, True), ("sliding", 0, True),
                                                 ("sliding", 2, True), ("sliding", 2, False),
                                                 ("segment", 3, False)])
def test_sinks_and_sliding(window, sinks, causal):
    # the sink keys (a run of the last launch after its own keys, last in priority; their
    # dk/dv summed atomically by the dq kernel) and sliding bands (masked window edges, union
    # intervals open towards the diagonal); two batch rows: row strides in every pointer,
    # including the sink keys' run; 2 query heads on 1 kv head: both add their sink dk/dv into
    # it (sinks with several kv heads: test_sinks_decode_maps_documents_and_offsets)
    _run(PAT.replace(window=window, sink_tokens=sinks), b=2, sq=50, hq=2, hkv=1, causal=causal)


def test_sliding_non_dividing_rates_and_long_windows():
    # windows longer than the sequence, w % r != 0, a rate (3) not dividing a later one (4):
    # per-pair union masks inside the sliding bands (per_head: test_sliding_random_patterns)
    _run(DilatedPattern([12, 20, 45, 200], [1, 3, 4, 8], query_dilation="all", window="sliding",
                        sink_tokens=5), sq=61, hq=2, hkv=2)


def test_sinks_decode_maps_documents_and_offsets():
    pat = PAT.replace(window="sliding", sink_tokens=4)
    _run(pat, sq=1, sk=75, use_lse=False)  # decode
    _run(pat, sq=19, sk=75)  # a chunk of prefill
    # (the cases below with 2 query heads on 1 kv head: the interpreter's time)
    one = dict(hq=2, hkv=1)
    perm = torch.randperm(61, device=DEV)
    _run(pat, sq=61, k_positions=perm, **one)  # a stored order: position map
    doc = torch.tensor([0] * 15 + [1] * 20 + [-1] * 5, device=DEV)  # padding
    _run(PAT.replace(sink_tokens=17), sq=40, q_doc_ids=doc, k_doc_ids=doc, **one)
    # packed documents with restarting positions: each document has its own sinks
    pos = torch.cat([torch.arange(15), torch.arange(25)]).to(DEV)
    doc = torch.tensor([0] * 15 + [1] * 25, device=DEV)
    _run(pat, sq=40, k_positions=pos, k_doc_ids=doc, **one)
    # queries and keys far from position 0 (a ring piece): no sink key in the call
    qp, kp = torch.arange(101, 138, device=DEV), torch.arange(70, 120, device=DEV)
    _run(pat, sq=37, sk=50, q_positions=qp, k_positions=kp, **one)
    # ... and keys that include the sinks, queries far away
    qp, kp = torch.arange(301, 338, device=DEV), torch.arange(0, 50, device=DEV)
    _run(pat, sq=37, sk=50, q_positions=qp, k_positions=kp, **one)


def test_sliding_random_patterns():
    # fresh random patterns: both modes, causal or not, sinks or not (a sweep in miniature)
    import random

    rng = random.Random(torch.initial_seed())
    for _ in range(3):
        n = rng.randint(1, 4)
        w = [rng.randint(1, 48) for _ in range(n)]
        r = [rng.randint(1, min(x, 7)) for x in w]
        mode = rng.choice(["per_head", "all"])
        if mode == "per_head" and 1 not in r:
            r[rng.randrange(n)] = 1
        pat = DilatedPattern(w, r, query_dilation=mode, window="sliding",
                             sink_tokens=rng.choice([0, 1, 5]))
        _run(pat, sq=rng.randint(2, 80), hq=4, hkv=2, causal=rng.random() < 0.6)


@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_sliding_band_edges_where_windows_do_not_divide(mode):
    # every earlier rate divides the launch's: the launch owns the keys from ceil(w_i / r) class
    # steps back (_band_edge), a moved diagonal instead of the union test; windows that are not
    # multiples of the rate put that edge between classes (a floor would be one step off), an
    # earlier window longer than the launch's own leaves it nothing, equal rates nest too
    for w, r in (([7, 17, 30], [1, 2, 4]), ([9, 12, 20], [1, 3, 3]), ([40, 16], [1, 2])):
        pat = DilatedPattern(w, r, query_dilation=mode, window="sliding", sink_tokens=2)
        q = torch.zeros(1, 4, 47, 16, device=DEV)
        plan, _ = plan_positions(check_inputs(q, q, q, pat), pat)
        launch = _calls._launches(pat, plan, True)[1]
        assert all(ln.npri == 0 for ln in launch), launch  # no union code in any of them
        _run(pat, sq=47, hq=4, hkv=2)
