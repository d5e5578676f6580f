"""Host µs per piece of one training attention call (forward with autograd, then its backward),
ours beside SDPA's, on a GPU host: which parts of our call cost what SDPA's does not.

python host_parts.py [SEQ] [CALLS]     (SmolLM2-135M heads: 9 / 3 x 64, bf16, default pattern)
"""
import sys
import time
from pathlib import Path

import torch
from triton.runtime.driver import driver

import hf_hilbert_attn.kernels as K
from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.kernels._plan import plan_positions
from hf_hilbert_attn.patterns import as_pattern

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "examples" / "benchmarks"))
from host_overhead import _per_call_us  # noqa: E402  (best over repeats of the mean per call)

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
dev, dt = torch.device("cuda"), torch.bfloat16
pat = as_pattern("default")
q = torch.randn(1, 9, S, 64, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(1, 3, S, 64, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(1, 3, S, 64, device=dev, dtype=dt, requires_grad=True)
ke, ve = (t.detach().repeat_interleave(3, 1).requires_grad_() for t in (k, v))
g = torch.ones_like(q)
sync = torch.cuda.synchronize


def host_us(fn, calls=CALLS, reps=5):
    return _per_call_us(fn, calls, reps)


def bwd_us(make, reps=5):
    """Host µs of a backward: CALLS forwards made first (synced), their backwards timed."""
    best = float("inf")
    for _ in range(reps):
        outs = [make() for _ in range(CALLS)]
        sync()
        t0 = time.perf_counter()
        for o in outs:
            torch.autograd.grad(o, (q, ke, ve) if make is sdpa else (q, k, v), g)
        best = min(best, (time.perf_counter() - t0) / CALLS * 1e6)
        del outs
        sync()
    return best


def ours():
    return dilated_attention(q, k, v, pat, backend="triton")


def sdpa():
    return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=True)


class Bare(torch.autograd.Function):  # what any autograd Function costs: two allocations each way
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def bare():
    return Bare.apply(q, k, v)


for _ in range(3):  # compile, fill caches
    torch.autograd.grad(ours(), (q, k, v), g)
    torch.autograd.grad(sdpa(), (q, ke, ve), g)
sync()
a = check_inputs(q, k, v, pat)
plan, _ = plan_positions(a, pat)
qd, kd, vd = q.detach(), k.detach(), v.detach()
out, lse = K.dilated_fwd(qd, kd, vd, pat, a.scale, True, plan)
rows = [("SDPA fwd (cuDNN/flash, kv expanded)", host_us(sdpa)),
        ("SDPA bwd", bwd_us(sdpa)),
        ("ours fwd", host_us(ours)),
        ("ours bwd", bwd_us(ours)),
        ("bare autograd.Function fwd (1 alloc)", host_us(bare)),
        ("bare autograd.Function bwd (3 allocs)", bwd_us(bare)),
        ("check_inputs", host_us(lambda: check_inputs(q, k, v, pat))),
        ("kernels.dilated_fwd", host_us(lambda: K.dilated_fwd(qd, kd, vd, pat, a.scale, True, plan))),
        ("kernels.dilated_bwd", host_us(lambda: K.dilated_bwd(g, qd, kd, vd, out, lse, None, pat,
                                                             a.scale, True, plan)))]
real = K._run
K._run = lambda *args: None
try:
    rows += [("ours fwd, launches skipped", host_us(ours)),
             ("ours bwd, launches skipped", bwd_us(ours)),
             ("dilated_fwd, launches skipped",
              host_us(lambda: K.dilated_fwd(qd, kd, vd, pat, a.scale, True, plan))),
             ("dilated_bwd, launches skipped",
              host_us(lambda: K.dilated_bwd(g, qd, kd, vd, out, lse, None, pat, a.scale, True,
                                            plan)))]
finally:
    K._run = real
cfg = K.kernel_config()
rows += [("_call_plans (fwd)", host_us(lambda: K._call_plans(
             K.plan_fwd, qd, kd, pat, plan, True, a.scale, cfg, (), (False,), 0, 0.0))),
         ("torch.empty_like(q)", host_us(lambda: torch.empty_like(qd))),
         ("torch.zeros 1x3x2x64 f32", host_us(lambda: torch.zeros((1, 3, 2, 64), device=dev))),
         ("is_current_stream_capturing", host_us(torch.cuda.is_current_stream_capturing)),
         ("driver current device+stream", host_us(
             lambda: driver.active.get_current_stream(driver.active.get_current_device()))),
         ("q.data_ptr()", host_us(qd.data_ptr)),
         ("kernel_config()", host_us(K.kernel_config))]
print(f"host µs per call, {torch.cuda.get_device_name()}, S={S}, 9/3 heads x 64, bf16, "
      f"default pattern, best of 5 x {CALLS} calls")
print("| piece | host µs |\n|---|---|")
for name, us in rows:
    print(f"| {name} | {us:.1f} |")
