"""Decode ms per token at very long contexts (512K-1M), SDPA flash included, stepped in turn in
one process. SDPA's own prefill of 1M tokens would take minutes, so every DynamicCache method
decodes from one cache, prefilled by the default pattern (a decode step's time does not depend
on the cached values; each step appends its token, so the context grows by a few tokens a
round). PatternCache runs prefill their own caches.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python docs/bench/speed/s35/decode_long.py 1048576 10

(Without expandable segments a PatternCache prefill beside the 32 GiB shared cache ran out of
an 80 GiB card's memory: the shared cache's growth leaves freed blocks of every size.)
"""
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_hilbert_attn
from hf_hilbert_attn import PatternCache, prefill
from hf_hilbert_attn.tools.models import MODEL_SHAPES

contexts, steps = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2])
dev = torch.device("cuda")


def build(method):
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    if method == "sdpa-flash":
        m.set_attn_implementation("sdpa")
        return m
    p = hf_hilbert_attn.patterns.as_pattern("default")
    return hf_hilbert_attn.configure(m, p.replace(dense_kv_heads=(0,)) if "kv0" in method else p)


methods = ["sdpa-flash", "default", "default+kv0", "default/pattern", "default+kv0/pattern"]
models = {m: build(m) for m in methods if "/" not in m}
for m in methods:
    models.setdefault(m, models[m.split("/")[0]])
print(torch.cuda.get_device_name(), flush=True)
for ctx in contexts:
    with torch.inference_mode():
        ids = torch.randint(3, 1000, (1, ctx), device=dev)
        t0 = time.perf_counter()
        shared = prefill(models["default"], ids, chunk_tokens=16384,
                         cache=DynamicCache(config=models["default"].config))
        print(f"prefill {ctx} (default, DynamicCache): {time.perf_counter() - t0:.1f} s", flush=True)
        state = {}
        for m in methods:
            cache = shared
            if m.endswith("/pattern"):
                cache = prefill(models[m], ids, chunk_tokens=16384, cache=PatternCache(models[m]))
            state[m] = [cache, ids[:, -1:]]
        times = {m: [] for m in methods}
        for i in range(steps + 3):
            for m in methods:
                cache, tok = state[m]
                ctxm = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if m == "sdpa-flash" \
                    else torch.autocast("cuda", enabled=False)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with ctxm:
                    out = models[m](input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i >= 3:
                    times[m].append((time.perf_counter() - t0) * 1e3)
                state[m][1] = tok
        med = {m: statistics.median(v) for m, v in times.items()}
        ratio = {m: statistics.median([a / b for a, b in zip(times[m], times["sdpa-flash"])])
                 for m in methods}
        print(f"1b ctx={ctx} " + "  ".join(f"{m} {med[m]:.2f}ms ({ratio[m]:.2f}x flash)"
                                           for m in methods), flush=True)
        del state, shared
        torch.cuda.empty_cache()
