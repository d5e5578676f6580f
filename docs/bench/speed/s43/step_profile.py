"""Where a short training step's host time goes, ours against SDPA: a 135M-shaped step
(bf16, gradient checkpointing, as ``bench model`` trains) profiled with cProfile for each method
in one process, and the functions whose own time differs most between them.

    python docs/bench/speed/s43/step_profile.py [S] [STEPS] [OUTDIR]
"""
import cProfile, os, pstats, sys, time
import torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
N = int(sys.argv[2]) if len(sys.argv) > 2 else 5
OUT = sys.argv[3] if len(sys.argv) > 3 else "."
dev = torch.device("cuda")
shape = MODEL_SHAPES["135m"]
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", as_pattern("default"))}
models = {m: build_model(shape, impl, torch.bfloat16, dev, pattern=p) for m, (impl, p) in methods.items()}
ids = torch.randint(0, shape["vocab_size"], (1, S), device=dev)


def step(m):
    train_step(models[m], ids); models[m].zero_grad(set_to_none=True)


stats = {}
for m in methods:
    for _ in range(3):
        step(m)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        step(m)
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) / N
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(N):
        step(m)
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    stats[m] = {k: (v[0] / N, v[2] / N * 1e6, v[3] / N * 1e6) for k, v in st.stats.items()}  # calls, tottime, cumtime us/step
    print(f"{m}: {1e3 * plain:.1f} ms a step unprofiled; profiled {sum(v[1] for v in stats[m].values()) / 1e3:.1f} ms of own time")
    with open(os.path.join(OUT, f"step_profile_{m}.txt"), "w") as f:
        st.stream = f
        st.sort_stats("tottime").print_stats(80)
        st.sort_stats("cumulative").print_stats(120)


def name(k):
    return f"{os.path.basename(k[0])}:{k[1]}({k[2]})"


keys = set(stats["sdpa"]) | set(stats["default"])
rows = []
for k in keys:
    a, b = stats["sdpa"].get(k, (0, 0, 0)), stats["default"].get(k, (0, 0, 0))
    rows.append((b[1] - a[1], name(k), a[0], b[0], a[1], b[1], a[2], b[2]))
rows.sort(key=lambda r: -abs(r[0]))
print("| function | calls sdpa / ours a step | own µs a step sdpa / ours | diff µs | cum µs sdpa / ours |")
print("|---|---|---|---|---|")
for d, n, ca, cb, ta, tb, ua, ub in rows[:60]:
    print(f"| {n} | {ca:.0f} / {cb:.0f} | {ta:.0f} / {tb:.0f} | {d:+.0f} | {ua:.0f} / {ub:.0f} |")
