"""Training steps as Trainer(bf16=True) runs them: float32 weights, the forward under
torch.autocast(bfloat16). SDPA, default, default + dense kv head 0 (same weights), stepped in
turn; per step the host time of the attention calls (the attention function, forward and
checkpoint recompute, and its backward node), and the step ratio to SDPA.

python step_autocast.py SHAPE LENGTHS ROUNDS TAG      (135m 4096,8192 6 new)
"""
import os
import statistics
import sys
import time

import torch
from transformers.modeling_utils import AttentionInterface

import hf_hilbert_attn  # noqa: F401 (registers hilbert_dilated)
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../s28/scripts"))
from step_insitu import N, T, timed  # noqa: E402 (the attention calls timed in place)

shape, lengths, rounds, tag = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], \
    int(sys.argv[3]), sys.argv[4]
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
           "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,)))}
models = {m: build_model(MODEL_SHAPES[shape], impl, torch.float32, dev, pattern=p)
          for m, (impl, p) in methods.items()}
for impl in ("sdpa", "hilbert_dilated"):
    AttentionInterface.register(impl, timed(impl, AttentionInterface._global_mapping[impl]))


def step(m, ids):
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        train_step(models[m], ids)
    models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


names = list(methods)
print(f"{torch.cuda.get_device_name()}, {shape}, float32 weights under bf16 autocast")
for n in lengths:
    ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, n), device=dev)
    for m in names:
        for _ in range(2):
            step(m, ids)
    t, host = {m: [] for m in names}, {m: [0.0, 0.0] for m in names}
    for r in range(rounds):
        for m in names[r % 3:] + names[:r % 3]:
            T.clear(), N.clear()
            t[m].append(step(m, ids))
            impl = methods[m][0]
            host[m][0] += T[impl + " fwd"] / max(N[impl + " fwd"], 1) / rounds
            host[m][1] += T[impl + " bwd"] / max(N[impl + " bwd"], 1) / rounds
    line = [f"{tag} {shape} {n}:"]
    for m in names:
        ratio = statistics.median(a / b for a, b in zip(t["sdpa"], t[m]))
        line.append(f"{m} {1e3 * statistics.median(t[m]):.1f} ms (x{ratio:.3f}; attention host "
                    f"{host[m][0] * 1e6:.0f} / {host[m][1] * 1e6:.0f} us fwd / bwd)")
    print("  ".join(line), flush=True)
