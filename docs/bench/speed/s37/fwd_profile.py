"""Where a 135M training forward's host time goes, Transformers' SDPA beside ours (S tokens):
the host ms of 5 forwards each (interleaved), then a cProfile of 3 forwards each, the functions
by own time and by cumulative time.

    python docs/bench/speed/s37/fwd_profile.py [S]
"""
import cProfile, io, pstats, statistics, sys, time
import torch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
dev = torch.device("cuda")
models = {"sdpa": build_model(MODEL_SHAPES["135m"], "sdpa", torch.bfloat16, dev),
          "default": build_model(MODEL_SHAPES["135m"], "hilbert_dilated", torch.bfloat16, dev,
                                 pattern=as_pattern("default"))}
ids = torch.randint(0, 49152, (1, S), device=dev)


def fwd(m):
    return m.model(input_ids=ids, use_cache=False).last_hidden_state


for m in models.values():
    for _ in range(3):
        fwd(m).float().sum().backward(); m.zero_grad(set_to_none=True)
t = {k: [] for k in models}
for _ in range(5):
    for k, m in models.items():
        torch.cuda.synchronize(); t0 = time.perf_counter(); h = fwd(m)
        t[k].append(1e3 * (time.perf_counter() - t0)); del h
print(f"{torch.cuda.get_device_name()} S={S} forward host ms: " +
      "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in t.items()), flush=True)
for k, m in models.items():
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3):
        h = fwd(m); del h
    pr.disable()
    for order, n in (("tottime", 22), ("cumtime", 40 if k == "default" else 16)):
        s = io.StringIO(); st = pstats.Stats(pr, stream=s)
        st.sort_stats(order).print_stats(n)
        print(f"\n#### {k} by {order}: {st.total_calls / 3:.0f} Python-level calls a forward\n" +
              "\n".join(l for l in s.getvalue().splitlines()[6:] if l.strip())[:7000], flush=True)
