"""First-use cost per prompt length in a fresh process (Triton cache on disk already warm):
generate() at L = 2K..16K, first vs second call, ours (PatternCache) and sdpa; cProfile of ours'
first calls."""
import cProfile, io, pstats, sys, time, os
import torch
import hf_hilbert_attn
from transformers import LlamaConfig, LlamaForCausalLM
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from hf_hilbert_attn.integrations.cache import PatternCache, cache_kwarg
torch.manual_seed(0)
shape = dict(MODEL_SHAPES["135m"]); shape.update(vocab_size=49152, max_position_embeddings=32768)
cfg = LlamaConfig(**shape)
which = sys.argv[1]
m = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
if which == "sdpa":
    m.set_attn_implementation("sdpa")
else:
    m = hf_hilbert_attn.configure(m, "default")
def gen(ids):
    extra = {cache_kwarg(m): PatternCache(m)} if which != "sdpa" else {}
    out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                     min_new_tokens=8, do_sample=False, pad_token_id=0, **extra)
    torch.cuda.synchronize()
    return out
pr = cProfile.Profile()
with torch.inference_mode():
    ids0 = torch.randint(100, 40000, (1, 64), device="cuda")
    t = time.perf_counter(); gen(ids0); print(f"{which} very first (64 tokens) {1e3*(time.perf_counter()-t):.0f} ms")
    for L in (2048, 4096, 8192, 16384):
        ids = torch.randint(100, 40000, (1, L), device="cuda")
        pr.enable(); t = time.perf_counter(); gen(ids); a = time.perf_counter() - t; pr.disable()
        t = time.perf_counter(); gen(ids); b = time.perf_counter() - t
        print(f"{which} L={L} first {1e3*a:.0f} ms second {1e3*b:.0f} ms", flush=True)
if which != "sdpa":
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45); print(s.getvalue()[:12000])
