"""Host us per decode launch, layer by layer of the launch path: launch_all's hit path, Triton's
CompiledKernel.run with prepared values (with and without the launch_metadata call), and the
C launcher under it called directly. Prints this Triton's CudaLauncher.__call__ source first.

python launch_floor.py [CTX]
"""
import inspect
import sys
from pathlib import Path

import torch
from triton.runtime.driver import driver

from hf_hilbert_attn.decode import plan_decode, run_decode
from hf_hilbert_attn.kernels import _launch
from hf_hilbert_attn.patterns import as_pattern

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "examples" / "benchmarks"))
from host_overhead import _per_call_us  # noqa: E402  (best over repeats of the mean per call)

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dev = torch.device("cuda")
import triton.backends.nvidia.driver as nvd  # noqa: E402

print(inspect.getsource(nvd.CudaLauncher.__call__))
pattern = as_pattern("default")
q = torch.randn(1, 32, 1, 64, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, 8, ctx, 64, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
plan = plan_decode(pattern, 32, 8, ctx, torch.arange(ctx - 1, ctx, device=dev),
                   torch.arange(ctx, device=dev))
run_decode(q, k, v, plan, 0.125)
run_decode(q, k, v, plan, 0.125)
launcher = plan._made
captured = []
real = _launch.launch_all
import hf_hilbert_attn.kernels._decode as kd  # noqa: E402

launcher._kept = None  # (the next call binds: its launch recorded)
kd.launch_all = lambda ls: (captured.append(ls), real(ls))
out = torch.empty(1, 1, 32, 64, device=dev, dtype=torch.bfloat16).transpose(1, 2)
launcher(q, k, v, 0.125, out)
kd.launch_all = real
(fn, grid, head, rest, kw, slot), = captured[0]
kernel, tail, addressed = next(iter(slot.values()))
device = driver.active.get_current_device()
stream = driver.active.get_current_stream(device)
guard, heads = _launch._addresses(head)
values = (*heads, *addressed, *tail)
print("arguments:", len(values), "values, of them tuples:", sum(isinstance(x, tuple) for x in values))


def per(fn_, n=200, rep=15):
    return _per_call_us(fn_, n, rep)


g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
rows = [
    ("DecodeLauncher call (a layer after the first)", lambda: launcher(q, k, v, 0.125, out)),
    ("launch_all, slot hit", lambda: real([(fn, grid, head, rest, kw, slot)])),
    ("Triton's whole launch (binding): fn[grid](...)", lambda: fn[grid](*head, *rest, **kw)),
    ("_addresses(head)", lambda: _launch._addresses(head)),
    ("driver device + stream", lambda: driver.active.get_current_stream(
        driver.active.get_current_device())),
    ("kernel.launch_metadata", lambda: kernel.launch_metadata(grid, stream, *values)),
    ("kernel.run, prepared values, metadata None", lambda: kernel.run(
        g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)),
    ("torch.empty(out).transpose", lambda: torch.empty(1, 1, 32, 64, device=dev,
                                                       dtype=torch.bfloat16).transpose(1, 2)),
    ("SDPA (flash choice) on the same q, k, v", lambda: torch.nn.functional
     .scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)),
]
for name, f in rows:
    print(f"| {name} | {per(f):.1f} |", flush=True)
