"""Where a decode step's host time goes: SDPA flash vs default (DynamicCache), 1B shape.
python decprof.py CTX STEPS"""
import cProfile, io, pstats, statistics, sys, time, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
import hf_hilbert_attn
from hf_hilbert_attn import prefill
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache
ctx, steps = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda")
def build(m):
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
    torch.manual_seed(0)
    with dev: model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).eval()
    if m == "sdpa-flash": model.set_attn_implementation("sdpa"); return model
    return hf_hilbert_attn.configure(model, hf_hilbert_attn.patterns.as_pattern("default"))
methods = ["sdpa-flash", "default"]
models = {m: build(m) for m in methods}
with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, ctx), device=dev)
    state = {m: [prefill(models[m], ids, chunk_tokens=16384, cache=DynamicCache(config=models[m].config)), ids[:, -1:]] for m in methods}
    def step(m):
        cache, tok = state[m]
        with (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if m == "sdpa-flash" else torch.autocast("cuda", enabled=False)):
            out = models[m](input_ids=tok, past_key_values=cache, use_cache=True)
        state[m][1] = out.logits[:, -1:].argmax(-1)
    times = {m: [] for m in methods}
    for i in range(steps):
        for m in methods:
            torch.cuda.synchronize(); t0 = time.perf_counter(); step(m); torch.cuda.synchronize()
            if i >= 3: times[m].append((time.perf_counter() - t0) * 1e3)
    print({m: round(statistics.median(v), 2) for m, v in times.items()}, flush=True)
    for m in methods + methods + methods[::-1]:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(steps): step(m)
        torch.cuda.synchronize(); pr.disable()
        st = pstats.Stats(pr)
        lin = [v for k, v in st.stats.items() if k[2] == "<built-in method torch._C._nn.linear>"]
        print(f"-- {m}: total {st.total_tt*1e3/steps:.2f} ms/step profiled, linear own "
              f"{lin[0][2]*1e6/lin[0][1]:.1f} us/call", flush=True)
        if "full" in sys.argv:
            for key, n in (("tottime", 35), ("cumulative", 60)):
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(n)
                print(f"== {m} {key}\n{s.getvalue()}", flush=True)
