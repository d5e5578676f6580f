"""Per-prompt time of the eval's passkey generate (8 new tokens), 135M shape, random weights:
sdpa vs ours with PatternCache and DynamicCache; prefill alone; then cProfile of ours."""
import cProfile, pstats, sys, time, io
import torch
import hf_hilbert_attn
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from hf_hilbert_attn.integrations.cache import PatternCache, cache_kwarg
torch.manual_seed(0)
import os
shape = dict(MODEL_SHAPES["135m"]); shape.update(vocab_size=49152, max_position_embeddings=32768)
if os.environ.get("LAYERS"): shape["num_hidden_layers"] = int(os.environ["LAYERS"])
cfg = LlamaConfig(**shape)
dev = os.environ.get("DEV", "cuda")
LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "2048 4096 16384").split()]
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
def model_for(impl, dense=()):
    m = LlamaForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
    if impl != "sdpa":
        m = hf_hilbert_attn.configure(m, hf_hilbert_attn.patterns.default().replace(dense_kv_heads=list(dense)))
    else:
        m.set_attn_implementation("sdpa")
    return m
def gen(m, ids, cache):
    extra = {}
    if cache == "pattern": extra = {cache_kwarg(m): PatternCache(m)}
    return m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                      min_new_tokens=8, do_sample=False, pad_token_id=0, **extra)
def prefill(m, ids, cache):
    c = PatternCache(m) if cache == "pattern" else DynamicCache(config=m.config)
    return m(input_ids=ids, **{cache_kwarg(m): c}, use_cache=True, logits_to_keep=1)
def timeit(fn, n):
    sync(); t = time.perf_counter()
    for _ in range(n): fn()
    sync(); return (time.perf_counter() - t) / n * 1e3
res = []
with torch.inference_mode():
    models = {"sdpa": model_for("sdpa"), "default": model_for("hd"), "kv0": model_for("hd", [0])}
    for L in LENGTHS:
        ids = torch.randint(100, 40000, (1, L), device=dev)
        for name, m in models.items():
            for cache in (("dynamic",) if name == "sdpa" else ("pattern", "dynamic")):
                gen(m, ids, cache); gen(m, ids, cache)
                g = timeit(lambda: gen(m, ids, cache), 5)
                p = timeit(lambda: prefill(m, ids, cache), 5)
                res.append((L, name, cache, g, p))
                print(f"L={L} {name:8s} {cache:8s} generate {g:7.1f} ms  prefill {p:6.1f} ms  (8 tokens: {(g-p)/8:5.2f} ms/token)", flush=True)
    ids = torch.randint(100, 40000, (1, LENGTHS[1]), device=dev)
    for name, cache in (("default", "pattern"), ("sdpa", "dynamic")):
        m = models[name]
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): gen(m, ids, cache)
        sync(); pr.disable()
        s = io.StringIO(); st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(30)
        print(f"==== profile {name} {cache} tottime"); print(s.getvalue()[:9000])
        s = io.StringIO(); st = pstats.Stats(pr, stream=s)
        st.sort_stats("cumtime").print_stats("hf_hilbert_attn", 40)
        print(f"==== profile {name} {cache} cumtime (ours)"); print(s.getvalue()[:9000])
