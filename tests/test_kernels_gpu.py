"""GPU tests of the Triton kernels (``gpu`` marker; run on the device machine).

Rule (flash-attention's): our error vs a float32 reference is at most 2× the error of PyTorch
doing the same masked attention in the same dtype, for out, dq, dk, dv. Outputs are poisoned
(NaN-filled cache blocks) before each run, and every case draws fresh random data.
"""

import pytest
import torch

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

pytestmark = pytest.mark.gpu

LONGNET_SMALL = DilatedPattern([256, 512, 1024, 2048, 4096], [1, 2, 4, 6, 12])


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
    mask = pattern.build_mask(hq, qp, kp, causal=causal, q_doc_ids=qd, k_doc_ids=kd)
    kk = k.repeat_interleave(hq // hkv, 1)
    vv = v.repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vv


def _grads(fn, inputs, dout):
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*ins)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in ins]


def _check(pattern, *, s, hq=4, hkv=2, d=128, sq=None, dtype=torch.bfloat16, causal=True, **kw):
    sq = sq or s
    q = torch.randn(1, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(1, hkv, s, d, device="cuda", dtype=dtype)
    v = torch.randn(1, hkv, s, d, device="cuda", dtype=dtype)
    dout = torch.randn(1, hq, sq, d, device="cuda", dtype=dtype)
    _poison()
    ours = _grads(lambda a, b, c: dilated_attention(a, b, c, pattern, causal=causal, **kw),
                  (q, k, v), dout)
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, pattern, causal=causal, **kw),
                 (q.float(), k.float(), v.float()), dout.float())
    base = _grads(lambda a, b, c: _torch_same_dtype(a, b, c, pattern, causal, **kw), (q, k, v), dout)
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        assert torch.isfinite(o).all(), f"{name}: non-finite values (unwritten output?)"
        err = (o.float() - r).abs().max().item()
        err_t = (t.float() - r).abs().max().item()
        assert err <= 2 * err_t + 1e-5, f"{name}: ours {err:.3e} vs PyTorch {err_t:.3e} (s={s})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [97, 1025, 4096])
def test_longnet_like(dtype, s):
    _check(LONGNET_SMALL, s=s, dtype=dtype)


@pytest.mark.parametrize("mode,causal", [("all", True), ("per_head", False), ("all", False)])
def test_modes(mode, causal):
    _check(LONGNET_SMALL.replace(query_dilation=mode), s=3001, hq=12, hkv=4, causal=causal)


def test_head_dim_64_and_mqa():
    _check(DilatedPattern([300, 1000], [1, 3]), s=2500, hq=6, hkv=1, d=64)


def test_16k_tokens():
    _check(DilatedPattern([2048, 4096, 8192, 16384], [1, 2, 4, 8]), s=16384, hq=2, hkv=1, d=64)


def test_position_map():
    s = 2049
    perm = torch.randperm(s, device="cuda")
    _check(LONGNET_SMALL, s=s, hq=4, hkv=2, k_positions=perm)


def test_packed_documents():
    # positions restarting per document: one kernel call per document (ops._document_runs)
    lengths = [700, 1300, 49, 1000]
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).cuda()
    _check(LONGNET_SMALL, s=sum(lengths), hq=8, hkv=2, k_positions=pos, k_doc_ids=doc)


def test_decode_matches_reference():
    s = 5000  # the last query sits mid-segment for every config
    for _ in range(2):
        _check(LONGNET_SMALL, s=s, sq=1, hq=8, hkv=2)


def test_torch_compile_fullgraph_with_backward():
    pat = LONGNET_SMALL

    def f(q, k, v):
        return dilated_attention(q, k, v, pat).float().square().sum()

    q = torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cf = torch.compile(f, fullgraph=True)
    loss_c = cf(q, k, v)
    gc = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = f(q, k, v)
    ge = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-3)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
