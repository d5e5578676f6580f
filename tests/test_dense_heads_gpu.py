"""Dense key/value heads on the GPU (``gpu`` marker): bf16 through the kernels and SDPA, against
the float32 reference, by flash-attention's rule (our error at most 2x PyTorch's own error doing
the same masked attention in bf16), for out, dq, dk, dv."""

import pytest
import torch

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

from test_kernels_gpu import _grads, _torch_same_dtype

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["natural", "documents", "positions"])
def test_dense_heads_bf16(case):
    p = DilatedPattern([256, 1024], [1, 4], window="sliding", sink_tokens=1, dense_kv_heads=[1])
    s, hq, hkv, d = 1537, 6, 3, 64
    q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    kw = {}
    if case == "documents":
        pos = torch.cat([torch.arange(700), torch.arange(s - 700)]).cuda()
        docs = (torch.arange(s) >= 700).long().cuda()
        kw = dict(q_positions=pos, k_positions=pos, q_doc_ids=docs, k_doc_ids=docs)
    elif case == "positions":
        pos = torch.randperm(s).cuda()
        kw = dict(q_positions=pos, k_positions=pos)
    ours = _grads(lambda a, b, c: dilated_attention(a, b, c, p, **kw), (q, k, v), dout)
    ref = _grads(lambda a, b, c: reference_attention(a, b, c, p, **kw),
                 (q.float(), k.float(), v.float()), dout.float())
    base = _grads(lambda a, b, c: _torch_same_dtype(a, b, c, p, True, **kw), (q, k, v), dout)
    for name, o, r, t in zip(("out", "dq", "dk", "dv"), ours, ref, base):
        assert torch.isfinite(o).all(), name
        err, err_t = (o.float() - r).abs().max().item(), (t.float() - r).abs().max().item()
        assert err <= 2 * err_t + 1e-5, f"{case} {name}: ours {err:.3e} vs PyTorch {err_t:.3e}"
