"""Decode ms/token, methods interleaved step by step in one process (host noise common-mode).
python interleave.py SHAPE CONTEXTS STEPS TAG; the steps of "sdpa-flash" run under SDPA's flash backend."""
import sys, time, statistics, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
import hf_hilbert_attn
from hf_hilbert_attn import PatternCache, prefill
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache
shape, contexts, steps = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
tag = sys.argv[4] if len(sys.argv) > 4 else ""
dev = torch.device("cuda")
def build(method):
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape])
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    if method.startswith("sdpa"):
        m.set_attn_implementation("sdpa"); return m
    p = hf_hilbert_attn.patterns.as_pattern("default")
    if "kv0" in method: p = p.replace(dense_kv_heads=(0,))
    return hf_hilbert_attn.configure(m, p)
methods = ["sdpa", "sdpa-flash", "default", "default+kv0", "default/pattern", "default+kv0/pattern"]
models = {m: build(m) for m in methods if "/" not in m}
for m in methods:  # a PatternCache run: the model of its method
    if "/" in m:
        models[m] = models[m.split("/")[0]]
for ctx in contexts:
    with torch.inference_mode():
        ids = torch.randint(3, 1000, (1, ctx), device=dev)
        state = {}
        for m in methods:
            model = models[m]
            cache = PatternCache(model) if m.endswith("/pattern") else DynamicCache(config=model.config)
            # (prefill in SDPA's default choice: chunks past the first carry a mask flash cannot take)
            cache = prefill(model, ids, chunk_tokens=16384, cache=cache)
            state[m] = [cache, ids[:, -1:]]
        times = {m: [] for m in methods}
        for i in range(steps + 3):
            for m in methods:
                cache, tok = state[m]
                ctxm = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if m == "sdpa-flash" else torch.autocast("cuda", enabled=False)
                torch.cuda.synchronize(); t0 = time.perf_counter()
                with ctxm:
                    out = models[m](input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i >= 3: times[m].append((time.perf_counter() - t0) * 1e3)
                state[m][1] = tok
        med = {m: statistics.median(v) for m, v in times.items()}
        ratio = {m: statistics.median([a / b for a, b in zip(times[m], times["sdpa-flash"])]) for m in methods}
        print(f"{tag} {shape} ctx={ctx} " + "  ".join(f"{m} {med[m]:.2f}ms ({ratio[m]:.2f}x flash)" for m in methods), flush=True)
        del state; torch.cuda.empty_cache()
