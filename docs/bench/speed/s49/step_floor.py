"""Issue 38's 1B row asks ≥ 2.5x SDPA's tokens/s at 64K with dense key/value heads. How far can
the step go? Steps interleaved as ``s20/scripts/stepinter.py`` (same weights, the order rotated
each round), with a fourth method: attention replaced by a copy of the values (each query head
takes its key/value head's values; the query and key projections stay in the graph through a
zero-weighted term), so that step's time is the step's floor — everything but attention. Printed:
ms per step, ÷ SDPA's tokens/s, and the bound ``t_sdpa / (t_floor + (t_kv0 - t_default))``: the
ratio with dense head 0 if the sparse part cost nothing and the dense head what it costs now.

    python docs/bench/speed/s49/step_floor.py 1b 65536 3
"""
import statistics
import sys
import time

import torch
from transformers import AttentionInterface

from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES


def values_only(module, query, key, value, attention_mask, **kwargs):
    """``[B, S, Hq, D]``: each query head's key/value head's values (no attention)."""
    g = query.shape[1] // value.shape[1]
    out = (value + 0 * key).repeat_interleave(g, dim=1) + 0 * query
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("values_only", values_only)
shape, lengths, rounds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
           "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,))),
           "floor": ("values_only", None)}
models = {m: build_model(MODEL_SHAPES[shape], impl, torch.bfloat16, dev, pattern=p)
          for m, (impl, p) in methods.items()}


def step(m, ids):
    torch.cuda.synchronize()
    t = time.perf_counter()
    train_step(models[m], ids)
    models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


names = list(methods)
for n in lengths:
    ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, n), device=dev)
    for m in names:
        for _ in range(2):
            step(m, ids)
    t = {m: [] for m in names}
    for r in range(rounds):
        for m in names[r % len(names):] + names[:r % len(names)]:
            t[m].append(step(m, ids))
    med = {m: statistics.median(v) for m, v in t.items()}
    line = [f"{shape} {n}:"] + [f"{m} {1e3 * med[m]:.1f} ms (x{med['sdpa'] / med[m]:.3f})"
                                for m in names]
    bound = med["sdpa"] / (med["floor"] + med["default+kv0"] - med["default"])
    print("  ".join(line) + f"  bound with dense head 0: x{bound:.2f}", flush=True)
