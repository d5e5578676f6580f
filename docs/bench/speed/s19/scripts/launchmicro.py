"""Host µs per call: run_decode, its launcher, relaunch alone, SDPA flash (135M heads, 8K keys)."""
import time, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import hf_hilbert_attn
from hf_hilbert_attn.decode import plan_decode, run_decode
from hf_hilbert_attn.kernels import _launch
from hf_hilbert_attn.kernels._common import Strided
dev = "cuda"
for hq, hkv, d, sk in ((9, 3, 64, 8192), (32, 8, 64, 32768)):
    q = torch.randn(1, hq, 1, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, sk, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    pat = hf_hilbert_attn.patterns.as_pattern("default")
    plan = plan_decode(pat, hq, hkv, sk, torch.arange(sk - 1, sk, device=dev), torch.arange(sk, device=dev))
    run_decode(q, k, v, plan, 0.125)
    L = plan._made
    out = torch.empty(1, 1, hq, d, device=dev, dtype=q.dtype).transpose(1, 2)
    fn, grid, ints, tail, bound = L._state
    args = (Strided(q, *q.stride()[:3]), Strided(k, *k.stride()[:3]), Strided(v, *v.stride()[:3]), Strided(out, *out.stride()[:3]), out, L.rule) + ints
    def t(f, n=2000):
        torch.cuda.synchronize(); f(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n): f()
        dt = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize(); return dt
    kq, kk = q.transpose(1, 2).contiguous().transpose(1, 2), k
    res = dict(run_decode=t(lambda: run_decode(q, k, v, plan, 0.125)),
               launcher=t(lambda: L(q, k, v, 0.125, out)),
               relaunch=t(lambda: _launch.relaunch(bound, grid, args)),
               kernel_run=t(lambda: bound[0].run(*grid, 1, torch.cuda.current_stream().cuda_stream, bound[0].function, bound[0].packed_metadata, None, None, None, *args, *bound[1])))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        res["sdpa_flash"] = t(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    # GPU time of one launch
    torch.cuda.synchronize(); e0 = torch.cuda.Event(True); e1 = torch.cuda.Event(True)
    e0.record(); [L(q, k, v, 0.125, out) for _ in range(200)]; e1.record(); torch.cuda.synchronize()
    res["gpu_ours"] = e0.elapsed_time(e1) / 200 * 1e3
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        e0.record(); [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for _ in range(200)]; e1.record(); torch.cuda.synchronize()
    res["gpu_flash"] = e0.elapsed_time(e1) / 200 * 1e3
    print(f"heads {hq}/{hkv} d={d} sk={sk} splits={grid}: " + "  ".join(f"{k} {v:.1f}us" for k, v in res.items()), flush=True)
