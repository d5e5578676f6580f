"""GPU tests of the Triton kernels (``gpu`` marker; run on the device machine).

Rule (flash-attention's): our error vs a float32 reference is at most 2× the error of PyTorch
doing the same masked attention in the same dtype, for out, dq, dk, dv. Outputs are poisoned
(NaN-filled cache blocks) before each run, and every case draws fresh random data.

The time of this file is Triton compiling kernels on a cold cache (seconds per specialization:
the constexpr flags, dtype, head dim, and whether integer strides are multiples of 16). A test
that mostly reuses another's specializations shares its ``xdist_group`` (one worker of ``-n 16``
compiles them once; ``--dist loadgroup``); a short one that does runs on its own, after the
unit that compiles them (Triton's disk cache is shared by the workers). tests/conftest.py plans
the units onto the workers from their recorded times, and each call compiles its kernels side
by side in threads (docs/decisions.md "GPU tests: planned units").
"""

import dataclasses

import pytest
import torch

from conftest import RANDN_MAX, attention_tol, eps, reorder_tol
from helpers import assert_close
from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

pytestmark = pytest.mark.gpu

LONGNET_SMALL = DilatedPattern([256, 512, 1024, 2048, 4096], [1, 2, 4, 6, 12])
EARLIER_SMALL = DilatedPattern([1024, 4096], [1, 4])
group = pytest.mark.xdist_group


def _ids(v):
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


# bfloat16, d 128, per_head, causal, segments (lse strides multiples of 16 or not: most
# kernels are the same specializations)
NATURAL = group("gpu_natural")
# packed documents: an odd total (as test_longnet_like's lengths) and two documents starting at
# storage rows that are not a multiple of 4 (their lse rows are not 16-byte aligned: kernels
# specialized for that)
DOC_LENGTHS = [700, 1301, 49, 1001]


def _poison():
    # Fill free cache blocks with NaN so outputs the kernels forget to write show up.
    x = torch.empty(512 * 2**20, device="cuda", dtype=torch.uint8)
    x.fill_(0xFF)
    del x


def _torch_same_dtype(q, k, v, pattern, causal, **kw):
    """Masked softmax attention in the input dtype (the PyTorch error we compare against)."""
    hq, hkv = q.shape[1], k.shape[1]
    sq, sk = q.shape[2], k.shape[2]
    qp = torch.arange(sk - sq, sk, device=q.device)
    kp = torch.arange(sk, device=q.device)
    kd = kw.get("k_doc_ids")
    qd = kw.get("q_doc_ids", kd)
    kp = kw.get("k_positions", kp)
    qp = kw.get("q_positions", kp if "k_positions" in kw and sq == sk else qp)
    mask = pattern.build_mask(hq, qp, kp, causal=causal, q_doc_ids=qd, k_doc_ids=kd,
                              num_kv_heads=hkv)
    kk = k.repeat_interleave(hq // hkv, 1)
    vv = v.repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if kw.get("softcap"):  # (Gemma 2's eager attention, in the input dtype)
        s = torch.tanh(s / kw["softcap"]) * kw["softcap"]
    # a query with no allowed key outputs 0 (as the op and the reference do), not NaN: the
    # finite fill keeps its softmax finite, the row factor zeroes it and its gradients
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    return (torch.softmax(s, -1) * mask.any(-1, keepdim=True)) @ vv


def _grads(fn, inputs, dout):
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in ins]


def _check(pattern, *, s, hq=4, hkv=2, d=128, sq=None, dtype=torch.bfloat16, causal=True, b=1,
           fn=dilated_attention, wide=0, **kw):
    """Out, dq, dk, dv of ``fn`` against the float64 reference within twice PyTorch's error in
    ``dtype``. ``wide``: q, k, v, dO as the first ``d`` features of ``[B, S, H, d + wide]``
    storage (rows ``(d + wide) * H`` elements apart)."""
    sq = sq or s
    q, k, v, dout = (torch.randn(b, n, h, d + wide, device="cuda", dtype=dtype)[..., :d]
                     .transpose(1, 2) if wide else
                     torch.randn(b, h, n, d, device="cuda", dtype=dtype)
                     for h, n in ((hq, sq), (hkv, s), (hkv, s), (hq, sq)))
    _poison()
    ins = [t.detach().requires_grad_() for t in (q, k, v)]  # (in their own layout)
    out = fn(*ins, pattern, causal=causal, **kw)
    out.backward(dout)
    ours = [out.detach()] + [t.grad for t in ins]
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, pattern, causal=causal, **kw),
                 (q.float(), k.float(), v.float()), dout.float())
    base = _grads(lambda a, b, c: _torch_same_dtype(a, b, c, pattern, causal, **kw), (q, k, v), dout)
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        assert torch.isfinite(o).all(), f"{name}: non-finite values (unwritten output?)"
        err = (o.float() - r).abs().max().item()
        err_t = (t.float() - r).abs().max().item()
        assert err <= 2 * err_t + 1e-5, f"{name}: ours {err:.3e} vs PyTorch {err_t:.3e} (s={s})"


@pytest.mark.parametrize("dtype,s", [
    pytest.param(torch.bfloat16, 97, marks=NATURAL),
    pytest.param(torch.bfloat16, 1025, marks=NATURAL),
    pytest.param(torch.bfloat16, 4096),  # (units of their own: ~23 s each, cold)
    *(pytest.param(torch.float16, s, marks=group("gpu_float16")) for s in (97, 1025)),
    pytest.param(torch.float16, 4096)],
    ids=_ids)
def test_longnet_like(dtype, s):
    _check(LONGNET_SMALL, s=s, dtype=dtype)


@pytest.mark.parametrize("mode,causal", [("all", True), ("per_head", False), ("all", False)])
def test_modes(mode, causal):
    _check(LONGNET_SMALL.replace(query_dilation=mode), s=3001, hq=12, hkv=4, causal=causal)


@pytest.mark.parametrize("case", ["sliding_sinks", "per_head_noncausal", "all_dense_head",
                                  "batch_float16", "unaligned_rows", "d64_sinks",
                                  "d64_unaligned_rows", "earlier", "earlier_all_noncausal",
                                  "d64_earlier", "mixed", "mixed_loop"])
def test_hopper_dkdv_kernel(case):
    """On an H100 the dk/dv launches at natural positions run the Gluon kernel
    (``kernels/_dkdv_wgmma.py``, D92, D95) at head size 128 and 64 and match the reference as
    ``_check`` asks: without an earlier config, with earlier ones covering whole query ranges,
    and with the per-pair union mask (``MIXED``: the key tables, ``mixed``, or the runtime loop
    over more than four earlier configs, ``mixed_loop``); ``earlier*`` and ``mixed*``: every
    dk/dv launch on it. q and dO rows it cannot load 16 bytes at a time (a row stride not a
    multiple of 8 elements) take the Triton kernel on the Gluon kernel's key tiles."""
    from hf_hilbert_attn.kernels import _dkdv_wgmma

    if _dkdv_wgmma.KERNEL is None or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon dk/dv kernel needs an sm_90 GPU and Triton 3.6")
    pattern, kw = {
        "sliding_sinks": (SLIDING_SMALL.replace(sink_tokens=2), dict(s=3001, hq=8, hkv=2)),
        "per_head_noncausal": (LONGNET_SMALL, dict(s=2049, hq=6, hkv=3, causal=False)),
        "all_dense_head": (SLIDING_SMALL.replace(query_dilation="all", dense_kv_heads=[1]),
                           dict(s=1500, hq=4, hkv=2)),
        "batch_float16": (LONGNET_SMALL.replace(sink_tokens=1), dict(s=1025, b=2,
                                                                     dtype=torch.float16)),
        "unaligned_rows": (SLIDING_SMALL, dict(s=1000, wide=1)),
        "d64_sinks": (LONGNET_SMALL.replace(sink_tokens=2), dict(s=2049, hq=9, hkv=3, d=64)),
        "d64_unaligned_rows": (SLIDING_SMALL, dict(s=1000, hq=6, hkv=2, d=64, wide=1)),
        # (rate 4's segments hold whole ones of rate 1 and 4 x 128 keys: not MIXED)
        "earlier": (EARLIER_SMALL, dict(s=5000, hq=8, hkv=2)),
        "earlier_all_noncausal": (EARLIER_SMALL.replace(query_dilation="all"),
                                  dict(s=4500, hq=4, hkv=2, causal=False)),
        "d64_earlier": (EARLIER_SMALL, dict(s=5000, hq=9, hkv=3, d=64)),
        # (rates 6 and 12 do not nest with 4: per-pair union masks; six configs: the loop)
        "mixed": (LONGNET_SMALL, dict(s=2049, hq=4, hkv=2)),
        "mixed_loop": (DilatedPattern([256, 512, 1024, 2048, 4096, 8192], [1, 2, 4, 6, 12, 24]),
                       dict(s=5000, hq=9, hkv=3, d=64)),
    }[case]
    cuda = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[cuda]) as prof:
        _check(pattern, **kw)
    ran = any("_dkdv_wgmma_kernel" in e.name for e in prof.events())
    assert ran == ("unaligned" not in case), f"the Gluon dk/dv kernel ran: {ran}"
    triton_ran = any(e.name.startswith("_dkdv_kernel") for e in prof.events())
    assert not (("earlier" in case or "mixed" in case) and triton_ran), \
        "a launch with earlier configs took Triton's"


def test_head_dim_64_and_mqa():
    _check(DilatedPattern([300, 1000], [1, 3]), s=2500, hq=6, hkv=1, d=64)


def test_head_dim_256():
    # Gemma's head size: its own tiles (32 x 32, 8 warps; dk/dv 16 queries a step), segments
    # with per-pair union masks, and a sliding window with sinks (the sink launch)
    _check(LONGNET_SMALL, s=2049, hq=4, hkv=2, d=256)
    _check(SLIDING_SMALL.replace(sink_tokens=2), s=1500, hq=4, hkv=1, d=256)


def test_soft_capped_scores():
    # Gemma 2's cap (1.5: it bends most scores of randn inputs) in every launch kind at its head
    # size: segments with per-pair union masks and the sink run; the sliding band with a dense
    # key/value head's launch
    _check(LONGNET_SMALL.replace(sink_tokens=2), s=2049, hq=4, hkv=2, d=256, softcap=1.5)
    _check(SLIDING_SMALL.replace(dense_kv_heads=[1]), s=1500, hq=4, hkv=2, d=256, softcap=1.5)


def test_16k_tokens():
    _check(DilatedPattern([2048, 4096, 8192, 16384], [1, 2, 4, 8]), s=16384, hq=2, hkv=1, d=64)


def test_position_map():
    s = 2049
    perm = torch.randperm(s, device="cuda")
    _check(LONGNET_SMALL, s=s, hq=4, hkv=2, k_positions=perm)


def test_packed_documents():  # own kernels (document ids), a unit of its own
    # positions restarting per document: one kernel call per document (backends.document_runs)
    lengths = DOC_LENGTHS
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    _check(LONGNET_SMALL, s=sum(lengths), hq=8, hkv=2, k_positions=pos, k_doc_ids=doc)


def test_first_call_compiles_its_kernels_together(monkeypatch):
    # a call planned anew compiles the kernels of all its launches in a thread pool before the
    # first launch (kernels._config._compile_together): no launch compiles one on its own
    import triton

    from hf_hilbert_attn import kernels

    monkeypatch.setattr(kernels._config, "_CONFIG",
                        dataclasses.replace(kernels.kernel_config(), compile_threads=4))
    kernels._calls._CALLS.clear()
    # (on an H100 with Triton 3.6 every dk/dv launch here takes the Gluon kernel)
    gluon = kernels._dkdv_wgmma.KERNEL if torch.cuda.get_device_capability() == (9, 0) else None
    fns = [kernels._fwd._fwd_kernel, kernels._bwd._dq_kernel,
           kernels._dkdv._dkdv_kernel if gluon is None else gluon]
    for fn in fns:
        fn.device_caches.clear()  # this process's kernels (Triton's disk cache stays)
    seen = []

    def hook(*, fn, is_manual_warmup, **_):
        seen.append((fn.name, is_manual_warmup))
        return None  # compile as usual

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", hook)
    q = torch.randn(1, 4, 3000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 3000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dilated_attention(q, k, v, LONGNET_SMALL).sum().backward()
    assert {n for n, _ in seen} == {fn.fn.__name__ for fn in fns}
    assert [n for n, warm in seen if not warm] == []
    assert len(seen) >= 8  # the union launches compile apart from the first config's


def test_decode_matches_reference():  # own kernels (one query), a unit of its own
    s = 5000  # the last query sits mid-segment for every config
    for _ in range(2):
        _check(LONGNET_SMALL, s=s, sq=1, hq=8, hkv=2)


def test_torch_compile_fullgraph_with_backward(monkeypatch):
    import torch._inductor.config

    # Inductor compiles this graph's few small kernels in this process: with its default pool
    # it starts a compile subprocess per CPU core (16 interpreters importing torch next to the
    # other workers' compiles) whose shutdown held this worker's exit for seconds
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    pat = LONGNET_SMALL

    def f(q, k, v):
        return dilated_attention(q, k, v, pat).float().square().sum()

    # the shapes of test_longnet_like[1025]: the same kernel specializations, compiled once
    q = torch.randn(1, 4, 1025, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 1025, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 1025, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cf = torch.compile(f, fullgraph=True)
    loss_c = cf(q, k, v)
    gc = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = f(q, k, v)
    ge = torch.autograd.grad(loss_e, (q, k, v))
    # Compiled and eager run the same kernels (the custom ops) on the same bf16 inputs; only
    # the graph around them is Inductor's. The loss: a float32 sum of the 4*1025*128 squares of
    # the bf16 output (each exact in float32, one sign) in another order: rule 1
    # (conftest.reorder_tol), relative to the loss itself (out has q's shape).
    assert torch.isfinite(loss_e)
    torch.testing.assert_close(loss_c, loss_e, rtol=reorder_tol(q.numel(), "float32"), atol=0)
    # The gradients: their dout, (2 * out).to(bf16), is exact in either graph, so only the
    # kernels' float32 sums could differ, where the compiled call orders them otherwise:
    # rule 1 for attention (conftest.attention_tol) over the longest sum, dk/dv's 2 query
    # heads per key/value head x 1025 queries (dq: 1025 keys), head_dim 128, each order within
    # that of the exact sum so twice that apart, RANDN_MAX times an output's for a gradient's
    # terms (as tests/test_kernels.py); plus each result's rounding to bfloat16 (one eps of
    # bf16 apart at most), relative to max(1, max|want|) (helpers.assert_close).
    tol = 2 * attention_tol(2 * 1025, 128, "float32") * RANDN_MAX + eps("bfloat16")
    for name, a, b in zip(("dq", "dk", "dv"), gc, ge):
        assert a.dtype == b.dtype == torch.bfloat16
        assert_close(name, a, b, tol, "compiled vs eager")


# (its own unit: mostly its own specializations (offsets, chunks))
def test_offset_runs_and_head_chunked_backward(monkeypatch):
    # queries and keys at consecutive positions from different starts (ring pieces: natural
    # loads with offsets, positions relative to a base), and float32 backward buffers forced
    # into chunks of one head
    from hf_hilbert_attn import kernels

    s = 1501  # odd, as test_longnet_like's: the same kernel specializations
    qp = torch.arange(70000, 70000 + s, device="cuda")
    kp = torch.arange(69000, 69000 + s, device="cuda")
    _check(LONGNET_SMALL, s=s, hq=8, hkv=2, q_positions=qp, k_positions=kp)
    with kernels.configured(acc_bytes=1):
        _check(LONGNET_SMALL, s=1025, hq=8, hkv=2)


@NATURAL
def test_launchers_write_into_views():
    # out/lse and dq/dk/dv written into rows of longer tensors, inputs read through views
    from hf_hilbert_attn.inputs import check_inputs
    from hf_hilbert_attn.kernels import dilated_bwd, dilated_fwd, plan_positions

    rows, n = slice(700, 2300), 3008  # 16-aligned rows and strides, as test_longnet_like[4096]
    big = {h: torch.randn(1, hh, n, 128, device="cuda", dtype=torch.bfloat16)
           for h, hh in (("q", 8), ("k", 2), ("v", 2), ("do", 8))}
    q, k, v, do = (big[x][:, :, rows] for x in ("q", "k", "v", "do"))
    pos = torch.arange(rows.start, rows.stop, device="cuda")
    a = check_inputs(q, k, v, LONGNET_SMALL, q_positions=pos, k_positions=pos)
    plan, _ = plan_positions(a, LONGNET_SMALL)
    ref_o, ref_l = dilated_fwd(q.contiguous(), k.contiguous(), v.contiguous(), LONGNET_SMALL,
                               a.scale, True, plan)
    _poison()
    o_big = torch.full((1, 8, n, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    l_big = torch.full((1, 8, n), float("nan"), device="cuda")
    dilated_fwd(q, k, v, LONGNET_SMALL, a.scale, True, plan, out=o_big[:, :, rows],
                lse=l_big[:, :, rows])
    assert torch.equal(o_big[:, :, rows], ref_o) and torch.equal(l_big[:, :, rows], ref_l)
    assert torch.isnan(o_big[:, :, :700].float()).all()
    ref_g = dilated_bwd(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), ref_o,
                        ref_l, None, LONGNET_SMALL, a.scale, True, plan)
    g_big = [torch.full_like(big[x], float("nan")) for x in ("q", "k", "v")]
    dilated_bwd(do, q, k, v, o_big[:, :, rows], l_big[:, :, rows], None, LONGNET_SMALL, a.scale,
                True, plan, *(g[:, :, rows] for g in g_big))
    for g, r in zip(g_big, ref_g):
        assert torch.equal(g[:, :, rows], r)


# (its own unit: mostly its own specializations (the lse gradient))
def test_an_lse_gradient_after_a_call_without_one_on_the_same_layout():
    # A planned backward keeps its compiled launches per layout (kernels/_launch.py, D69); its
    # delta pass compiles with and without an lse gradient on the same heads' guards, so a call
    # with one after a call without must run its own: dq, dk, dv against float64, within twice
    # PyTorch's error in bfloat16 (the lse term weighted up: ignoring it fails by far). Errors as
    # relative Frobenius norms: over 12 seeds ours is 1.36-1.49x PyTorch's, the lse term left
    # out 423-467x (dq, dk); the largest error alone moved 1.00-2.04x, failing one seed in six
    # (H200, docs/bench/speed/s29/call5_lse_grad_errors_H200.txt).
    s = 1025
    q = torch.randn(1, 4, s, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g, gl = torch.randn_like(q).double(), 10 * torch.randn(1, 4, s, device="cuda").double()

    def grads(fn, dtype, lse_too):
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, lse = fn(*ins, LONGNET_SMALL, return_lse=True)
        loss = (o.double() * g).sum() + ((lse.double() * gl).sum() if lse_too else 0)
        return torch.autograd.grad(loss, ins)

    grads(dilated_attention, torch.bfloat16, False)  # this layout's launches, no lse gradient
    ours = grads(dilated_attention, torch.bfloat16, True)
    truth = grads(reference_attention, torch.float64, True)
    base = grads(reference_attention, torch.bfloat16, True)
    for name, o, t, b in zip(("dq", "dk", "dv"), ours, truth, base):
        err, err_b = ((x.double() - t).norm().item() / t.norm().item() for x in (o, b))
        assert err <= 2 * err_b, f"{name}: ours {err:.3e} vs PyTorch {err_b:.3e} (relative)"


# (its own unit: mostly its own specializations (alignment))
def test_relaunch_without_binding_follows_alignment():
    # A planned call launched again goes straight to the compiled kernels (kernels/_launch.py)
    # while every tensor keeps its dtype and 16-byte alignment: fresh data of the same layout
    # gives the right result, and lse rows at a storage offset that is not 16-byte aligned take
    # the kernels compiled for that (not the aligned ones).
    from hf_hilbert_attn.inputs import check_inputs
    from hf_hilbert_attn.kernels import _launch, dilated_fwd, plan_positions

    if not _launch.fast_launches_enabled():
        pytest.skip("this Triton's JITFunction.run differs: every launch binds")
    before = _launch.fast_launches
    for _ in range(2):
        _check(LONGNET_SMALL, s=1025)
    assert _launch.fast_launches > before
    if _launch._TRITON_36:  # (and there through the launcher's C function)
        assert any(c[0] is not None for c in _launch._C.values())
    s, n = 1025, 1200
    q = torch.randn(1, 4, s, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, s, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, s, 128, device="cuda", dtype=torch.bfloat16)
    a = check_inputs(q, k, v, LONGNET_SMALL)
    plan, _ = plan_positions(a, LONGNET_SMALL)
    ref_o, ref_l = dilated_fwd(q, k, v, LONGNET_SMALL, a.scale, True, plan)
    for start in (32, 33, 32, 33):  # lse rows at 128 and 132 bytes: aligned, then not
        o = torch.full((1, 4, n, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        l = torch.full((1, 4, n), float("nan"), device="cuda")
        dilated_fwd(q, k, v, LONGNET_SMALL, a.scale, True, plan, out=o[:, :, start:start + s],
                    lse=l[:, :, start:start + s])
        assert torch.equal(o[:, :, start:start + s], ref_o)
        assert torch.equal(l[:, :, start:start + s], ref_l)


@NATURAL
def test_captured_in_a_cuda_graph():
    # Forward and backward replayed from CUDA graphs (what torch.compile's "reduce-overhead"
    # mode and make_graphed_callables do): planning happens in the eager warm-up, the captured
    # call only launches (no host sync), and a replay on new data equals the eager call.
    def attend(q, k, v):
        return dilated_attention(q, k, v, LONGNET_SMALL)

    shapes = [(1, 4, 1025, 128), (1, 2, 1025, 128), (1, 2, 1025, 128)]
    args = [torch.randn(sh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for sh in shapes]
    graphed = torch.cuda.make_graphed_callables(attend, tuple(args))
    for _ in range(2):
        x = [torch.randn(sh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
             for sh in shapes]
        dout = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16)
        got = graphed(*x)
        g_got = torch.autograd.grad(got, x, dout)
        want = attend(*x)
        g_want = torch.autograd.grad(want, x, dout)
        assert torch.equal(got, want)
        for a, b in zip(g_got, g_want):
            assert torch.equal(a, b)


def _fill_small_blocks():
    # Reuse freed small allocator blocks (the caches' tables live there) with 0xFF bytes.
    return [torch.full((n // 4,), -1, device="cuda", dtype=torch.int32)
            for n in (512, 1024, 2048, 4096, 8192, 65536) for _ in range(64)]


def test_reduce_overhead_compile_replays_cuda_graphs(monkeypatch):
    # torch.compile(mode="reduce-overhead"): after a warm-up and a recording, forward and
    # backward replay CUDA graphs (the op's Python does not run, no graph skipped) and equal
    # eager calls on new data, also after our plan caches were cleared and their memory
    # reused (what a few hundred other shapes would do): a captured call's tables are kept.
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from hf_hilbert_attn import kernels
    from hf_hilbert_attn.kernels import _plan

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    calls = []
    for name in ("dilated_fwd", "dilated_bwd"):
        def counted(*a, _fn=getattr(kernels, name), _name=name, **kw):
            calls.append(_name)
            return _fn(*a, **kw)
        monkeypatch.setattr(kernels, name, counted)

    def f(q, k, v):
        return dilated_attention(q, k, v, LONGNET_SMALL)

    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    shapes = [(1, 4, 1025, 128), (1, 2, 1025, 128), (1, 2, 1025, 128)]
    counters.clear()
    for step in range(5):
        x = [torch.randn(sh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
             for sh in shapes]
        dout = torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16)
        if step == 4:
            for cache in (kernels._calls._CALLS, kernels._calls._SMALL, _plan._KEY_CACHE):
                cache.clear()
            junk = _fill_small_blocks()
        before = len(calls)
        torch.compiler.cudagraph_mark_step_begin()
        got = cf(*x)
        g_got = torch.autograd.grad(got, x, dout)
        if step >= 3:
            assert len(calls) == before, calls[before:]
        got, g_got = got.clone(), [g.clone() for g in g_got]
        want = f(*x)
        g_want = torch.autograd.grad(want, x, dout)
        assert torch.equal(got, want)
        for a, b in zip(g_got, g_want):
            assert torch.equal(a, b)
    assert counters["inductor"]["cudagraph_skips"] == 0
    del junk


def test_ring_local_pieces():
    # a zigzag-like shard (two runs of positions) through the ring's local pieces: merged
    # launches into float32 sums, their backward into dq/dk/dv sums (head size 64: the pieces'
    # positions and launch lists do not depend on it; mapped positions at D 128 are
    # test_position_map's)
    from hf_hilbert_attn.ring import local_attention

    pos = torch.cat([torch.arange(0, 2048), torch.arange(6144, 8192)]).cuda()
    _check(LONGNET_SMALL, s=4096, hq=8, hkv=2, d=64, fn=local_attention, q_positions=pos,
           k_positions=pos)


@NATURAL  # test_longnet_like's shapes: its kernels, compiled once in that worker
def test_autocast_runs_mixed_dtypes_in_bf16():
    # a RoPE'd model under autocast hands float32 q/k and a bf16 v: the call runs in bf16
    q, k, v = (torch.randn(1, h, 1025, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for h in (4, 2, 2))
    want = dilated_attention(q, k, v, LONGNET_SMALL)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dilated_attention(q.float(), k.float(), v, LONGNET_SMALL)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=0, rtol=0)


SLIDING_SMALL = DilatedPattern([256, 512, 1024, 2048, 4096], [1, 2, 4, 8, 16], window="sliding")


SEGMENT_SINKS = group("gpu_segment_sinks")
SLIDING_SINKS = group("gpu_sliding_sinks")


@pytest.mark.parametrize("window,sinks,dtype", [
    pytest.param("segment", 1, torch.bfloat16, marks=SEGMENT_SINKS),
    pytest.param("segment", 4, torch.bfloat16, marks=SEGMENT_SINKS),
    ("sliding", 0, torch.bfloat16),
    pytest.param("sliding", 4, torch.bfloat16, marks=SLIDING_SINKS),
    # float16 once here, with both the sliding band and the sink launch (its other kernels:
    # test_longnet_like); each float16 case compiles kernels of its own
    ("sliding", 4, torch.float16)], ids=_ids)
def test_sinks_and_sliding(window, sinks, dtype):
    # LongNet-like rates (6 and 12 not dividing 4: per-pair union masks) with both window kinds
    # and sink tokens (the sink launch, its atomic dk/dv)
    _check(LONGNET_SMALL.replace(window=window, sink_tokens=sinks), s=3001, hq=12, hkv=4,
           dtype=dtype, b=2)


@pytest.mark.parametrize("mode,causal,d", [("all", True, 64), ("per_head", False, 128),
                                           ("all", False, 64)])
def test_sliding_modes_with_sinks(mode, causal, d):
    _check(SLIDING_SMALL.replace(query_dilation=mode, sink_tokens=3), s=2500, hq=6, hkv=2, d=d,
           causal=causal)


@pytest.mark.parametrize("case", [
    pytest.param("decode", marks=SLIDING_SINKS),
    "position_map",
    pytest.param("documents", marks=SLIDING_SINKS),
    pytest.param("offsets", marks=SEGMENT_SINKS)])
def test_sliding_sinks_decode_positions_and_documents(case):
    pat = SLIDING_SMALL.replace(sink_tokens=4)
    if case == "decode":  # one query at the end of a long cache
        for _ in range(2):
            _check(pat, s=5000, sq=1, hq=8, hkv=2)
    elif case == "position_map":  # a stored order (Hilbert-like)
        perm = torch.randperm(2049, device="cuda")
        _check(pat, s=2049, hq=4, hkv=2, k_positions=perm)
    elif case == "documents":  # packed documents: sinks are the first tokens of each document
        lengths = DOC_LENGTHS
        pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
        _check(pat, s=sum(lengths), hq=8, hkv=2, k_positions=pos, k_doc_ids=doc)
    else:  # offsets: no sink key in this call
        qp = torch.arange(70000, 71501, device="cuda")
        kp = torch.arange(69000, 70501, device="cuda")
        _check(pat, s=1501, hq=8, hkv=2, q_positions=qp, k_positions=kp)
