"""Host us per layer of one decode step, ours beside SDPA's (flash) layer call, and the pieces of
ours: one layer's real call (a random model of SHAPE, CTX tokens prefilled) recorded, then
replayed CALLS times per repeat without a sync (the queue absorbs the launches).

python decode_layers.py SHAPE CTX CALLS [kv0|pattern]
"""
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import hf_hilbert_attn
from hf_hilbert_attn import PatternCache, prefill
from hf_hilbert_attn.integrations import transformers as hi
from hf_hilbert_attn.tools.models import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "examples" / "benchmarks"))
from host_overhead import _per_call_us  # noqa: E402  (best over repeats of the mean per call)

shape, ctx, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
variant = sys.argv[4] if len(sys.argv) > 4 else ""
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape])
torch.manual_seed(0)
with dev:
    model = LlamaForCausalLM(cfg)
model.to(torch.bfloat16).eval()
pattern = hf_hilbert_attn.patterns.as_pattern("default")
if variant == "kv0":
    pattern = pattern.replace(dense_kv_heads=(0,))
hf_hilbert_attn.configure(model, pattern)

recorded = []


def recorder(module, q, k, v, mask, **kw):
    if not recorded:
        recorded.append((module, q, k, v, mask, kw))
    return hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)


with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, ctx), device=dev)
    cache = PatternCache(model) if variant == "pattern" else DynamicCache(config=model.config)
    cache = prefill(model, ids, chunk_tokens=16384, cache=cache)
    AttentionInterface.register("hilbert_dilated", recorder)
    try:
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    finally:
        AttentionInterface.register("hilbert_dilated", hi.hilbert_dilated_attention_forward)
    module, q, k, v, mask, kw = recorded[0]
    print(f"{shape} ctx={ctx} {variant or 'default'}: q {tuple(q.shape)} k {tuple(k.shape)} "
          f"mask {type(mask).__name__} kwargs {sorted(kw)} on "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}")

    torch.manual_seed(0)
    with dev:  # (a config of its own: setting its attention must not touch ours)
        ref = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape]))
    ref.to(torch.bfloat16).eval()
    ref.set_attn_implementation("sdpa")
    caches = {"ours": cache, "sdpa-flash": prefill(ref, ids, chunk_tokens=16384,
                                                  cache=DynamicCache(config=ref.config))}

    def whole_steps(label):
        import gc

        models = {"ours": model, "sdpa-flash": ref}
        gcs = {"n": 0, "t": 0.0, "t0": 0.0}

        def cb(phase, info):
            if phase == "start":
                gcs["t0"] = time.perf_counter()
            else:
                gcs["n"] += 1
                gcs["t"] += time.perf_counter() - gcs["t0"]

        gc.callbacks.append(cb)
        times = {m: [] for m in models}
        collected = {m: [0, 0.0] for m in models}
        tok = ids[:, -1:]
        for i in range(23):
            for name in models:
                n0, t0g = gcs["n"], gcs["t"]
                sync()
                t0 = time.perf_counter()
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "sdpa-flash" else \
                        torch.autocast(dev.type, enabled=False):
                    models[name](input_ids=tok, past_key_values=caches[name], use_cache=True)
                sync()
                if i >= 3:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                    collected[name][0] += gcs["n"] - n0
                    collected[name][1] += (gcs["t"] - t0g) * 1e3
        gc.callbacks.remove(cb)
        for name in models:
            print(f"| step {name} ({label}) | {statistics.median(times[name]):.2f} ms | gc "
                  f"{collected[name][0]} collections, {collected[name][1]:.2f} ms in 20 steps |")

    whole_steps('first')

    if dev.type == "cuda":  # where a step's device time goes, ours and SDPA's
        from torch.profiler import ProfilerActivity, profile

        for name, m in (("ours", model), ("sdpa-flash", ref)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "sdpa-flash" else \
                            torch.autocast(dev.type, enabled=False):
                        m(input_ids=ids[:, -1:], past_key_values=caches[name], use_cache=True)
                sync()
            print(f"== {name}: 3 steps by device time")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))

    def per_call(fn, repeats=15):
        return _per_call_us(fn, calls, repeats)

    scaling = kw.get("scaling")
    rows = []

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa_attention_forward(module, q, k, v, None, **kw)

    rows.append(("SDPA layer call (flash, the sdpa_kernel context included)", sdpa_flash))
    rows.append(("SDPA layer call (default backend choice)",
                 lambda: sdpa_attention_forward(module, q, k, v, None, **kw)))
    rows.append(("ours: layer call", lambda: hi.hilbert_dilated_attention_forward(
        module, q, k, v, mask, **kw)))
    rest = {n: x for n, x in kw.items() if n not in ("dropout", "scaling", "is_causal")}
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    rows.append(("ours: _layer_sizes", lambda: hi._layer_sizes(mask, module.config, sq, sk)))
    rows.append(("ours: _checked_pattern", lambda: hi._checked_pattern(
        module, 0.0, True, b, sq, sk, mask, mask, rest)))
    rows.append(("ours: kernel_widths", lambda: hi.kernel_widths(q, k, v, scaling)))
    rows.append(("ours: _decode_step", lambda: hi._decode_step(
        q, k, v, mask, mask, pattern, scaling, rest, False)))
    hit = [x for kk, x in mask._memo.items() if isinstance(kk, tuple) and kk[0] == "decode"]
    if hit:
        plan = hit[0][2]
        from hf_hilbert_attn.decode import run_decode

        rows.append(("ours: run_decode", lambda: run_decode(q, k, v, plan, scaling)))
        out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=dev).transpose(1, 2)
        rows.append(("ours: out = empty().transpose()", lambda: torch.empty(
            b, sq, hq, d, dtype=q.dtype, device=dev).transpose(1, 2)))
        if plan._made is not None and dev.type == "cuda":
            rows.append(("ours: DecodeLauncher call", lambda: plan._made(q, k, v, scaling, out)))
    o = hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)[0]
    rows.append(("ours: _layer_output", lambda: hi._layer_output(o.transpose(1, 2), None, d)))
    for name, fn in rows:
        fn()
        print(f"| {name} | {per_call(fn):.1f} |", flush=True)

    # ---- a layer call that makes the step's plan (its first layer: a fresh mask memo)
    import dataclasses

    def first_layer():
        m = dataclasses.replace(mask, _memo={})
        return hi.hilbert_dilated_attention_forward(module, q, k, v, m, **kw)

    print(f"| ours: a step's first layer call (plans the step) | {per_call(first_layer, 5):.1f} |")

    whole_steps('after the layer timings')
