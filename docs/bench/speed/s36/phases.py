"""A 135M training step in phases, methods interleaved round by round in one process: host time
of the forward and the backward (Python returned, no sync) and the GPU's tail after each (the
wait at a sync), medians over rounds. Methods: sdpa (its default backend), sdpa under the flash
backend, ours (default pattern), ours with the dense pattern (the SDPA route through our adapter),
and ours with every kernel relaunch skipped (all of our host work, none of our GPU work: the
loss is garbage, the time is what the host alone costs).

    python docs/bench/speed/s36/phases.py [S] [ROUNDS]
"""
import statistics, sys, time
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, lm_loss
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
R = int(sys.argv[2]) if len(sys.argv) > 2 else 8
dev = torch.device("cuda")
shape = MODEL_SHAPES["135m"]
methods = {"sdpa": ("sdpa", None), "sdpa-flash": ("sdpa", None),
           "default": ("hilbert_dilated", as_pattern("default")),
           "ours-dense": ("hilbert_dilated", as_pattern("dense")),
           "default-nolaunch": ("hilbert_dilated", as_pattern("default"))}
from hf_hilbert_attn.kernels import _launch
_relaunch = _launch.relaunch
models = {m: build_model(shape, impl, torch.bfloat16, dev, pattern=p) for m, (impl, p) in methods.items()}
ids = torch.randint(0, shape["vocab_size"], (1, S), device=dev)
labels = torch.full_like(ids, -100)
labels[:, :-1] = ids[:, 1:]


def step(name):
    m = models[name]
    ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "sdpa-flash" else torch.autocast("cuda", enabled=False)
    torch.cuda.synchronize()
    _launch.relaunch = (lambda *a, **k: None) if name == "default-nolaunch" and warm else _relaunch
    with ctx:
        t0 = time.perf_counter()
        hidden = m.model(input_ids=ids, use_cache=False).last_hidden_state
        loss = lm_loss(hidden, m.get_output_embeddings().weight, labels, 2048)
        t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter(); torch.cuda.synchronize(); t4 = time.perf_counter()
    m.zero_grad(set_to_none=True)
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t4 - t3)


warm = False
for name in methods:
    for _ in range(3):
        step(name)
warm = True
res = {n: [] for n in methods}
mallocs = {n: 0 for n in methods}
for r in range(R):
    names = list(methods)
    for n in names[r % 5:] + names[:r % 5]:
        a = torch.cuda.memory_stats().get("num_device_alloc", 0)
        res[n].append(step(n))
        mallocs[n] += torch.cuda.memory_stats().get("num_device_alloc", 0) - a
print(f"{torch.cuda.get_device_name()} 135m S={S}, {R} rounds, ms (median): fwd host | fwd tail | bwd host | bwd tail | total")
for n, v in res.items():
    cols = [statistics.median(x[i] for x in v) for i in range(4)]
    tot = statistics.median(sum(x) for x in v)
    print(f"  {n:11s} " + " | ".join(f"{c:7.2f}" for c in cols) + f" | {tot:7.2f} | cudaMallocs in {R} steps {mallocs[n]}", flush=True)
