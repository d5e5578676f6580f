"""Host µs per attention call, ours beside SDPA's flash backend, forward and backward, at the
SmolLM2-135M attention shape (9 / 3 heads x 64, bf16), and a CPU-side profile of each backward:
where the host time of a short training step's attention goes.

    python docs/bench/speed/s35/bwd_host.py [S]
"""
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.patterns import as_pattern

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dev, dt = "cuda", torch.bfloat16
q = torch.randn(1, 9, S, 64, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(1, 3, S, 64, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(1, 3, S, 64, device=dev, dtype=dt, requires_grad=True)
g = torch.randn(1, 9, S, 64, device=dev, dtype=dt)
pat = as_pattern("default")


def ours():
    return dilated_attention(q, k, v, pat, backend="triton")


def flash():  # what Transformers' sdpa layer runs: key/value heads repeated, causal
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)


def bwd(o):
    return torch.autograd.grad(o, (q, k, v), g)


def host(fn, calls=20, repeats=15):
    best_f = best_b = 1e9
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for o in outs:
            bwd(o)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        best_f, best_b = min(best_f, (t1 - t0) / calls), min(best_b, (t3 - t2) / calls)
    return best_f * 1e6, best_b * 1e6


for fn in (ours, flash):
    for _ in range(5):
        bwd(fn())
torch.cuda.synchronize()
print(f"{torch.cuda.get_device_name()} S={S}: host us per call (fwd / bwd)")
for name, fn in (("ours", ours), ("sdpa flash", flash)):
    f, b = host(fn)
    print(f"  {name:10s} {f:7.1f} / {b:7.1f}")
for name, fn in (("ours", ours), ("sdpa flash", flash)):
    outs = [fn() for _ in range(10)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for o in outs:
            bwd(o)
        torch.cuda.synchronize()
    print(f"\n== {name}: 10 backward calls, CPU side")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
