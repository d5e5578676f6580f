"""Training steps of one method alone, for a sampling profiler to watch (py-spy with native
frames): ``python step_spy.py SHAPE SEQ STEPS METHOD`` (METHOD: sdpa, default, default+kv0;
bf16, random weights, B = 1, gradient checkpointing as `bench model`). Prints ms per step; the
steps between the markers ``STEPS-START`` / ``STEPS-END`` are the ones to read."""
import sys
import time

import torch

from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

shape, S, steps, method = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dev = torch.device("cuda")
pat = as_pattern("default")
impl, p = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
           "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,)))}[method]
model = build_model(MODEL_SHAPES[shape], impl, torch.bfloat16, dev, pattern=p)
ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, S), device=dev)
for _ in range(3):
    train_step(model, ids)
    model.zero_grad(set_to_none=True)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(steps):
    train_step(model, ids)
    model.zero_grad(set_to_none=True)
torch.cuda.synchronize()
print(f"{method} {shape} S={S}: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms/step "
      f"({torch.cuda.get_device_name()})", flush=True)
