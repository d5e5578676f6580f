"""A 135M training step where the default pattern is dense (2K: our op's SDPA route) beside
Transformers' own SDPA, one process: step wall time interleaved round by round, then per method
one profiled step: the CUDA kernels (name, count, µs) and the top self-CPU ops, and a cProfile of
our step's Python.

    python docs/bench/speed/s37/route2k.py [S] [ROUNDS]
"""
import cProfile, io, pstats, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
R = int(sys.argv[2]) if len(sys.argv) > 2 else 10
dev = torch.device("cuda")
ids = torch.randint(0, 49152, (1, S), device=dev)
models = {"sdpa": build_model(MODEL_SHAPES["135m"], "sdpa", torch.bfloat16, dev),
          "default": build_model(MODEL_SHAPES["135m"], "hilbert_dilated", torch.bfloat16, dev,
                                 pattern=as_pattern("default"))}


def step(m):
    train_step(m, ids); m.zero_grad(set_to_none=True)


for m in models.values():
    for _ in range(3):
        step(m)
walls = {k: [] for k in models}
for _ in range(R):
    for k, m in models.items():
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(m)
        torch.cuda.synchronize(); walls[k].append(time.perf_counter() - t0)
base = statistics.median(walls["sdpa"])
print(f"{torch.cuda.get_device_name()} 135m S={S}, {R} rounds: " + ", ".join(
    f"{k} {1e3 * statistics.median(w):.1f} ms (tokens/s ÷ sdpa {base / statistics.median(w):.3f})"
    for k, w in walls.items()), flush=True)
for k, m in models.items():
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(m); torch.cuda.synchronize()
    ev = prof.key_averages()
    cuda = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: -e.self_device_time_total)
    print(f"\n#### {k}: {sum(e.count for e in cuda)} kernels, "
          f"{sum(e.self_device_time_total for e in cuda) / 1e3:.2f} ms GPU")
    for e in cuda[:14]:
        print(f"  {e.count:5d} {e.self_device_time_total / 1e3:8.2f} ms  {e.key[:110]}")
    cpu = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)
    print(f"  CPU ops: {sum(e.count for e in cpu)} calls; top self-CPU:")
    for e in cpu[:16]:
        print(f"  {e.count:5d} {e.self_cpu_time_total / 1e3:8.2f} ms  {e.key[:80]}")
pr = cProfile.Profile()
pr.enable(); step(models["default"]); torch.cuda.synchronize(); pr.disable()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:5000])
