"""Garbage collection and threads in short training steps, ours against SDPA: a 135M-shaped step
(bf16, gradient checkpointing, as ``bench model`` trains) per method, rounds interleaved, with
the cyclic collector on (collections and their time per generation, from ``gc.callbacks``),
off (``gc.disable()``), and on after ``gc.freeze()``; the Python threads alive.

    python docs/bench/speed/s43/step_gc.py [S] [ROUNDS]
"""
import gc, statistics, sys, threading, time
import torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
R = int(sys.argv[2]) if len(sys.argv) > 2 else 6
dev = torch.device("cuda")
shape = MODEL_SHAPES["135m"]
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", as_pattern("default"))}
models = {m: build_model(shape, impl, torch.bfloat16, dev, pattern=p) for m, (impl, p) in methods.items()}
ids = torch.randint(0, shape["vocab_size"], (1, S), device=dev)
gcs = {}  # generation -> [count, seconds] in the current step
_t = {}


def cb(phase, info):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        g = gcs.setdefault(info["generation"], [0, 0.0])
        g[0] += 1
        g[1] += time.perf_counter() - _t[0]


gc.callbacks.append(cb)


def step(m):
    gcs.clear()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    train_step(models[m], ids); models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, {g: tuple(v) for g, v in gcs.items()}


for m in methods:
    for _ in range(3):
        step(m)
print("threads:", [t.name for t in threading.enumerate()], "gc thresholds", gc.get_threshold(),
      "tracked objects", len(gc.get_objects()))
for mode in ("gc on", "gc off", "gc frozen"):
    if mode == "gc off":
        gc.disable()
    if mode == "gc frozen":
        gc.enable(); gc.collect(); gc.freeze()
    res = {m: [] for m in methods}
    coll = {m: {} for m in methods}
    for r in range(R):
        for m in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
            t, g = step(m)
            res[m].append(t)
            for k, (n, s) in g.items():
                c = coll[m].setdefault(k, [0, 0.0]); c[0] += n; c[1] += s
    line = [f"{mode}:"]
    for m in methods:
        gtxt = ", ".join(f"gen{k} {n / R:.1f}x {1e3 * s / R:.2f} ms" for k, (n, s) in sorted(coll[m].items()))
        line.append(f"{m} {1e3 * statistics.median(res[m]):.1f} ms a step [{gtxt}]")
    ratio = statistics.median(a / b for a, b in zip(res["sdpa"], res["default"]))
    print("  ".join(line), f" default tokens/s / sdpa's {ratio:.3f}", flush=True)
