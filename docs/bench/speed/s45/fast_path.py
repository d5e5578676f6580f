"""Whether a call's launches take the fast relaunch path (``kernels._launch``) with the Gluon
dk/dv kernel in its backward, and the host µs of a forward + backward at a shape where the host
bounds it (SmolLM2-135M's heads, 9 / 3 x 64, 4K, the default pattern), the library against the
Triton dk/dv kernel (a dk/dv tile override turns the Gluon kernel off) in one process.

    python docs/bench/speed/s45/fast_path.py
"""
import time

import torch

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import _launch, configure
from hf_hilbert_attn.patterns import as_pattern

pat = as_pattern("default")
q, k, v, g = (torch.randn(1, h, 4096, 64, device="cuda", dtype=torch.bfloat16)
              for h in (9, 3, 3, 9))
for t in (q, k, v):
    t.requires_grad_(True)
for name, blocks in (("gluon dk/dv", None), ("triton dk/dv", {"dkdv": (16, 64, 4, 3)}),
                     ("gluon dk/dv", None)):
    configure(blocks=blocks)
    for _ in range(5):
        dilated_attention(q, k, v, pat).backward(g)
    torch.cuda.synchronize()
    n0, t0 = _launch.fast_launches, time.perf_counter()
    for _ in range(50):
        dilated_attention(q, k, v, pat).backward(g)  # (host time: no synchronize between)
    host = (time.perf_counter() - t0) / 50
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 50
    print(f"{name:14s} fast launches a call {(_launch.fast_launches - n0) / 50:5.1f}  "
          f"host {1e6 * host:7.1f} µs  wall {1e6 * wall:7.1f} µs", flush=True)
configure(blocks=None)
