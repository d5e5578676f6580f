"""Where a short training step's and a decode step's time goes, ours beside SDPA's, one process:
host syncs (torch.cuda sync debug mode), garbage collections, host time to the end of the step's
Python (no sync), GPU busy time (profiler kernels), the top self-CPU ops and Python functions.

    python docs/bench/speed/s36/anatomy.py [train|decode|both]
"""
import cProfile, gc, io, pstats, statistics, sys, time, warnings
import torch
from torch.profiler import ProfilerActivity, profile
import hf_hilbert_attn
from hf_hilbert_attn import prefill
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

what = sys.argv[1] if len(sys.argv) > 1 else "both"
dev = torch.device("cuda")
pat = as_pattern("default")
GC = {"n": [0, 0, 0], "t": 0.0, "t0": 0.0}


def _gc(phase, info):
    if phase == "start":
        GC["t0"] = time.perf_counter()
    else:
        GC["t"] += time.perf_counter() - GC["t0"]
        GC["n"][info["generation"]] += 1


gc.callbacks.append(_gc)


def anatomy(name, step, n=5):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, wall = [], []
    GC.update(n=[0, 0, 0], t=0.0)
    for _ in range(n):
        t0 = time.perf_counter(); step(); t1 = time.perf_counter()
        torch.cuda.synchronize(); t2 = time.perf_counter()
        host.append(t1 - t0); wall.append(t2 - t0)
    gcs = (list(GC["n"]), GC["t"] / n)
    gc.disable(); nogc = []
    for _ in range(n):
        t0 = time.perf_counter(); step(); torch.cuda.synchronize(); nogc.append(time.perf_counter() - t0)
    gc.enable()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    syncs = {}
    for x in w:
        if "synchroniz" in str(x.message):
            where = f"{x.filename.split('site-packages/')[-1].split('hf_hilbert_attn/')[-1]}:{x.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    ev = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    nk = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n#### {name}: wall {1e3*statistics.median(wall):.2f} ms, host (Python to the step's "
          f"end) {1e3*statistics.median(host):.2f} ms, GPU kernels {gpu/1e3:.2f} ms ({nk} kernels), "
          f"gc collections per {n} steps by generation {gcs[0]}, gc {1e3*gcs[1]:.2f} ms/step, wall with gc off {1e3*statistics.median(nogc):.2f} ms, "
          f"syncs in one step {sum(syncs.values())}: {syncs}", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    pr = cProfile.Profile()
    pr.enable(); step(); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:6000], flush=True)


if what in ("train", "both"):
    for S in (4096,):
        ids = torch.randint(0, 49152, (1, S), device=dev)
        for name, impl, p in (("sdpa", "sdpa", None), ("default", "hilbert_dilated", pat)):
            m = build_model(MODEL_SHAPES["135m"], impl, torch.bfloat16, dev, pattern=p)
            def step(m=m):
                train_step(m, ids); m.zero_grad(set_to_none=True)
            anatomy(f"135m train {S} {name}", step)
            del m; torch.cuda.empty_cache()

if what in ("decode", "both"):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (1, 4096), device=dev)
    for name in ("sdpa-flash", "default"):
        if name == "default":
            hf_hilbert_attn.configure(m, pat)
        else:
            m.set_attn_implementation("sdpa")
        with torch.inference_mode():
            cache = prefill(m, ids, chunk_tokens=16384, cache=DynamicCache(config=m.config))
            tok = ids[:, -1:]
            def step():
                global tok
                ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "sdpa-flash" else torch.autocast("cuda", enabled=False)
                with ctx:
                    out = m(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            anatomy(f"1b decode 4K {name}", step, n=10)
        del cache; torch.cuda.empty_cache()
