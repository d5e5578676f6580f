"""Where a decode step's host time goes, ours beside SDPA (flash), inside the steps: the
attention function and the mask function of each model timed per call while whole steps run
(interleaved, one process), then the host-side syncs and copies of 5 steps each (torch
profiler, CPU events).

python decode_insitu.py SHAPE CTX STEPS
"""
import statistics
import sys
import time
from collections import Counter, defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hf_hilbert_attn
from hf_hilbert_attn import prefill
from hf_hilbert_attn.integrations import transformers as hi
from hf_hilbert_attn.tools.models import MODEL_SHAPES

shape, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
T, N = defaultdict(float), Counter()


def timed(name, fn):
    def f(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        T[name] += time.perf_counter() - t
        N[name] += 1
        return r
    return f


def build(impl):
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape]))
    m.to(torch.bfloat16).eval()
    if impl == "sdpa":
        m.set_attn_implementation("sdpa")
        return m
    return hf_hilbert_attn.configure(m, hf_hilbert_attn.patterns.as_pattern("default"))


models = {"ours": build("ours"), "sdpa-flash": build("sdpa")}
AttentionInterface.register("hilbert_dilated", timed("ours attn", hi.hilbert_dilated_attention_forward))
AttentionInterface.register("sdpa", timed("sdpa-flash attn", sdpa_attention_forward))
AttentionMaskInterface.register("hilbert_dilated", timed("ours mask", hi.hilbert_dilated_mask))
AttentionMaskInterface.register("sdpa", timed("sdpa-flash mask", sdpa_mask))
with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, ctx), device=dev)
    state = {m: [prefill(models[m], ids, chunk_tokens=16384, cache=DynamicCache(
        config=models[m].config)), ids[:, -1:]] for m in models}

    def step(m):
        cache, tok = state[m]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if m == "sdpa-flash" else \
                torch.autocast("cuda", enabled=False):
            out = models[m](input_ids=tok, past_key_values=cache, use_cache=True)
        state[m][1] = out.logits[:, -1:].argmax(-1)

    times = {m: [] for m in models}
    for i in range(steps + 3):
        if i == 3:
            T.clear(), N.clear()
        for m in models:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(m)
            torch.cuda.synchronize()
            if i >= 3:
                times[m].append((time.perf_counter() - t0) * 1e3)
    print(f"{shape} ctx={ctx} on {torch.cuda.get_device_name()}, {steps} steps each, interleaved")
    for m in models:
        print(f"| {m} step | {statistics.median(times[m]):.2f} ms |")
    for k in sorted(T):
        print(f"| {k} | {T[k] * 1e6 / max(N[k], 1):.1f} µs x {N[k] / steps:.0f}/step = "
              f"{T[k] * 1e3 / steps:.3f} ms/step |")
    for m in models:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step(m)
            torch.cuda.synchronize()
        c = Counter()
        for e in prof.events():
            if any(s in e.name for s in ("Synchronize", "Memcpy", "item", "_local_scalar",
                                         "cudaLaunchKernel", "cuLaunchKernel", "Memset")):
                c[e.name] += 1
        print(f"== {m}, 5 steps: " + ", ".join(f"{n} {v}" for n, v in c.most_common(12)))
