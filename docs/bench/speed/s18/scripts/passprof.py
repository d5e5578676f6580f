"""The eval's passkey prompts on the real SmolLM2-135M: per prompt, sdpa and ours interleaved
(generate as hf_generate_fn does: ours through a PatternCache), time and new tokens; then a
cProfile of each at 4K."""
import cProfile, io, pstats, sys, time
import torch
import hf_hilbert_attn
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_hilbert_attn.integrations.cache import PatternCache, cache_kwarg
from hf_hilbert_attn.tools.evaluation.passkey import passkey_prompts
import os
DEV = os.environ.get("DEV", "cuda")
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
LS = [int(x) for x in os.environ.get("LS", "2048 4096 8192").split()]
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
def load(impl):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa").to(DEV).eval()
    return hf_hilbert_attn.configure(m, "default") if impl == "ours" else m
models = {"sdpa": load("sdpa"), "ours": load("ours")}
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
@torch.inference_mode()
def gen(name, ids):
    m = models[name]
    extra = {cache_kwarg(m): PatternCache(m)} if name == "ours" else {}
    out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                     do_sample=False, pad_token_id=pad, **extra)
    SYNC()
    return out.shape[1] - ids.shape[1]
for L in LS:
    ps = passkey_prompts(tok, L, [0, 0.25, 0.5, 0.75, 1], 8)
    for p in ps[:2]:
        gen("sdpa", p.input_ids.to(DEV)); gen("ours", p.input_ids.to(DEV))
    tot = {"sdpa": [0.0, 0], "ours": [0.0, 0]}
    for i, p in enumerate(ps):
        ids = p.input_ids.to(DEV)
        for name in (("sdpa", "ours") if i % 2 else ("ours", "sdpa")):
            t = time.perf_counter(); n = gen(name, ids); tot[name][0] += time.perf_counter() - t
            tot[name][1] += n
    print(f"L={L} prompts={len(ps)} " + "  ".join(f"{k}: {v[0]:.2f} s, {v[1]} new tokens" for k, v in tot.items()), flush=True)
ps = passkey_prompts(tok, LS[1], [0.5], 8)
for name in ("ours", "sdpa"):
    pr = cProfile.Profile(); pr.enable()
    for p in ps: gen(name, p.input_ids.to(DEV))
    pr.disable(); s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(35); print("====", name); print(s.getvalue()[:8000])
