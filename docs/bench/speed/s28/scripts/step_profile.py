"""Where a short training step's time goes: the GPU's busy time against the step's wall time,
attention kernels apart, for SDPA and ours (same weights), then the host's profile of ours.

python step_profile.py [SHAPE] [SEQ] [STEPS]     (135m 4096 6: bf16, random weights, B = 1,
gradient checkpointing as `bench model`)
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

shape = sys.argv[1] if len(sys.argv) > 1 else "135m"
S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 6
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
           "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,)))}
ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, S), device=dev)
ATTN = ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel", "flash", "fmha", "cudnn",
        "attention", "sdpa")


def steps(model, n):
    for _ in range(n):
        train_step(model, ids)
        model.zero_grad(set_to_none=True)


def busy(intervals):
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


print(f"{torch.cuda.get_device_name()}, {shape} at {S}, bf16, {STEPS} steps profiled")
print("| method | wall ms/step | GPU busy ms/step | kernels/step | attention kernels ms/step "
      "| attention launches/step | host launch API ms/step |")
print("|---|---|---|---|---|---|---|")
models = {}
for name, (impl, p) in methods.items():
    model = models[name] = build_model(MODEL_SHAPES[shape], impl, torch.bfloat16, dev, pattern=p)
    steps(model, 3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        steps(model, STEPS)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / STEPS * 1e3
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    att = [e for e in kern if any(a in e.name.lower() for a in ATTN) or "kernel" in e.name
           and e.name.startswith("_")]
    api = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                  "cuLaunchKernelEx", "cudaLaunchKernelExC")]
    iv = [(e.time_range.start, e.time_range.end) for e in kern]
    print(f"| {name} | {wall:.2f} | {busy(iv) / 1e3 / STEPS:.2f} | {len(kern) / STEPS:.0f} | "
          f"{sum(e.time_range.elapsed_us() for e in att) / 1e3 / STEPS:.2f} | "
          f"{len(att) / STEPS:.0f} | {sum(e.time_range.elapsed_us() for e in api) / 1e3 / STEPS:.2f} |",
          flush=True)
    if name == "default":
        names = {}
        for e in att:
            n, t = names.get(e.name, (0, 0.0))
            names[e.name] = (n + 1, t + e.time_range.elapsed_us())
        for n, (c, t) in sorted(names.items(), key=lambda x: -x[1][1])[:8]:
            print(f"  {n[:60]}: {c / STEPS:.0f} launches, {t / c:.1f} µs each")

for name in ("default", "sdpa"):
    pr = cProfile.Profile()
    pr.enable()
    steps(models[name], STEPS)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    if name == "default":
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("hf_hilbert_attn", 45)
    print(f"--- host profile of {name}, {STEPS} steps (tottime; ours: cumulative too) ---")
    print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))
