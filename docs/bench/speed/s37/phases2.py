"""A 135M training step in phases, with a control: two identical SDPA models beside ours, rounds
interleaved in rotating order; host ms of the forward and the backward (Python returned, no sync),
the GPU's tail after each, and garbage collections per step. Where the control pair differs,
the method is biased; what ours differs by beyond that is ours.

    python docs/bench/speed/s37/phases2.py [S] [ROUNDS]
"""
import gc, statistics, sys, time
import torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, lm_loss
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
R = int(sys.argv[2]) if len(sys.argv) > 2 else 12
dev = torch.device("cuda")
shape = MODEL_SHAPES["135m"]
methods = {"sdpa": ("sdpa", None), "sdpa-copy": ("sdpa", None),
           "default": ("hilbert_dilated", as_pattern("default"))}
models = {m: build_model(shape, impl, torch.bfloat16, dev, pattern=p) for m, (impl, p) in methods.items()}
ids = torch.randint(0, shape["vocab_size"], (1, S), device=dev)
labels = torch.full_like(ids, -100)
labels[:, :-1] = ids[:, 1:]
GC = [0]
gc.callbacks.append(lambda phase, info: GC.__setitem__(0, GC[0] + (phase == "start")))


def step(name):
    m = models[name]
    torch.cuda.synchronize()
    g0 = GC[0]
    t0 = time.perf_counter()
    hidden = m.model(input_ids=ids, use_cache=False).last_hidden_state
    loss = lm_loss(hidden, m.get_output_embeddings().weight, labels, 2048)
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter(); torch.cuda.synchronize(); t4 = time.perf_counter()
    m.zero_grad(set_to_none=True)
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t4 - t3), GC[0] - g0


for name in methods:
    for _ in range(3):
        step(name)
res = {n: [] for n in methods}
names = list(methods)
for r in range(R):
    for n in names[r % 3:] + names[:r % 3]:
        res[n].append(step(n))
print(f"{torch.cuda.get_device_name()} 135m S={S}, {R} rounds, ms (median): fwd host | fwd tail | "
      f"bwd host | bwd tail | step | ÷ sdpa step (median of rounds) | gc per step")
for n, v in res.items():
    cols = [statistics.median(x[i] for x in v) for i in range(4)]
    tot = [sum(x[:4]) for x in v]
    ratio = statistics.median(a / b for a, b in zip(tot, (sum(x[:4]) for x in res["sdpa"])))
    print(f"  {n:10s} " + " | ".join(f"{c:7.2f}" for c in cols) +
          f" | {statistics.median(tot):7.2f} | {ratio:.3f} | {sum(x[4] for x in v) / R:.1f}", flush=True)
