"""Where the host time of a short training step goes: sdpa vs default, one process.
python stepprof.py SHAPE SEQ OUTDIR
Per method: median step time (interleaved), then a torch.profiler (CPU) table of the step's
autograd nodes and ops by total CPU time, and a cProfile of the Python by own time."""
import cProfile, io, pstats, statistics, sys, time, torch
from torch.profiler import ProfilerActivity, profile
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES
shape, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dev = torch.device("cuda")
pat = as_pattern("default")
methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat)}
models = {m: build_model(MODEL_SHAPES[shape], i, torch.bfloat16, dev, pattern=p) for m, (i, p) in methods.items()}
ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, n), device=dev)
def step(m):
    torch.cuda.synchronize(); t = time.perf_counter()
    train_step(models[m], ids); models[m].zero_grad(set_to_none=True)
    torch.cuda.synchronize(); return time.perf_counter() - t
for m in methods:
    for _ in range(3): step(m)
t = {m: [] for m in methods}
for r in range(8):
    for m in (methods if r % 2 == 0 else list(methods)[::-1]): t[m].append(step(m))
print({m: round(1e3 * statistics.median(v), 1) for m, v in t.items()}, flush=True)
for m in methods:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2): step(m)
    tab = prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70)
    open(f"{out}/prof_{m}_{n}.txt", "w").write(tab)
    print(f"== {m}: torch profiler, 2 steps, by total CPU\n{tab}", flush=True)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(4): step(m)
    pr.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(40)
        open(f"{out}/cprof_{m}_{n}_{key}.txt", "w").write(s.getvalue())
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"== {m}: cProfile, 4 steps, by own time\n{s.getvalue()}", flush=True)
