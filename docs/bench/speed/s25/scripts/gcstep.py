"""Time spent in Python's garbage collector per training step: sdpa vs default, interleaved.
python gcstep.py SHAPE SEQ ROUNDS [--no-freeze]"""
import gc, statistics, sys, time, torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES
shape, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat)}
models = {m: build_model(MODEL_SHAPES[shape], i, torch.bfloat16, dev, pattern=p) for m, (i, p) in methods.items()}
ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, n), device=dev)
acc = {"t": 0.0, "n": [0, 0, 0], "t0": 0.0}
def cb(phase, info):
    if phase == "start": acc["t0"] = time.perf_counter()
    else: acc["t"] += time.perf_counter() - acc["t0"]; acc["n"][info["generation"]] += 1
gc.callbacks.append(cb)
def step(m):
    acc["t"], acc["n"] = 0.0, [0, 0, 0]
    torch.cuda.synchronize(); t = time.perf_counter()
    train_step(models[m], ids); models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize(); return time.perf_counter() - t, acc["t"], tuple(acc["n"])
for m in methods:
    for _ in range(3): step(m)
for label, freeze in (("gc as is", False), ("after gc.freeze()", True))[:1 if "--no-freeze" in sys.argv else 2]:
    if freeze: gc.collect(); gc.freeze()
    res = {m: [] for m in methods}
    for r in range(rounds):
        for m in (methods if r % 2 == 0 else list(methods)[::-1]): res[m].append(step(m))
    for m, v in res.items():
        print(f"{label} {m} {n}: step median {1e3*statistics.median(x[0] for x in v):.1f} ms, mean "
              f"{1e3*statistics.mean(x[0] for x in v):.1f} ms, gc "
              f"{1e3*statistics.median(x[1] for x in v):.2f} ms/step (max {1e3*max(x[1] for x in v):.1f}), "
              f"collections per step gen0/1/2 {[round(statistics.mean(x[2][g] for x in v), 2) for g in range(3)]}, "
              f"gc total {1e3*sum(x[1] for x in v):.0f} ms in {len(v)} steps", flush=True)
