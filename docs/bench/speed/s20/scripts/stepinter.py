"""Training steps interleaved step by step: sdpa, default, default+kv0 (same weights), per-round ratios.
python stepinter.py SHAPE LENGTHS ROUNDS TAG"""
import sys, time, statistics, torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES
shape, lengths, rounds, tag = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
           "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,)))}
models = {m: build_model(MODEL_SHAPES[shape], impl, torch.bfloat16, dev, pattern=p) for m, (impl, p) in methods.items()}
def step(m, ids):
    torch.cuda.synchronize(); t = time.perf_counter()
    train_step(models[m], ids); models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize(); return time.perf_counter() - t
names = list(methods)
for n in lengths:
    ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, n), device=dev)
    for m in names:
        for _ in range(3): step(m, ids)
    t = {m: [] for m in names}
    for r in range(rounds):
        order = names[r % 3:] + names[:r % 3]
        for m in order: t[m].append(step(m, ids))
    line = [f"{tag} {shape} {n}:"]
    for m in names:
        ratios = [a / b for a, b in zip(t["sdpa"], t[m])]
        line.append(f"{m} {1e3*statistics.median(t[m]):.1f} ms (x{statistics.median(ratios):.3f} sdpa tokens/s)")
    print("  ".join(line), flush=True)
