"""Decode speed side by side: milliseconds per new token after a long context, for ``sdpa`` and
``hilbert_dilated`` (a pattern, optionally with dense key/value heads), with a DynamicCache and
a PatternCache, or through ``generate()`` with a StaticCache (which Transformers compiles with
CUDA graphs), on random-initialised Llama shapes (``tools.models.MODEL_SHAPES``).

Per (shape, context, method, cache): the context is prefilled in chunks (``prefill``), then
``--steps`` greedy steps of one token are timed (after ``--warmup`` unmeasured ones), each a
model forward with the cache, synchronised at the end. ``--before`` adds, in the same process,
the ``hilbert_dilated`` rows with the decode plan turned off (every layer through the op, as
before the plan/run split), for a before/after in one run. Writes a CSV (``--csv``).

    python examples/benchmarks/decode_speed.py --shapes 1b 135m --contexts 4k 32k \
        --methods sdpa sdpa-flash default default+kv0 --caches dynamic pattern --before \
        --csv OUT.csv
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_hilbert_attn.tools.benchmarks.common import write_csv
from hf_hilbert_attn.tools.evaluation.bench_generate import _sdpa_backends as _backends
from hf_hilbert_attn.tools.evaluation.bench_generate import parse_tokens as _tokens


def build(shape: str, method: str, dtype, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_hilbert_attn
    from hf_hilbert_attn.tools.models import MODEL_SHAPES

    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(dtype).eval()
    if method.startswith("sdpa"):
        model.set_attn_implementation("sdpa")
        return model
    name, _, dense = method.partition("+kv")
    pattern = hf_hilbert_attn.patterns.as_pattern(name)
    if dense:
        pattern = pattern.replace(dense_kv_heads=tuple(int(j) for j in dense.split(",")))
    return hf_hilbert_attn.configure(model, pattern)


@torch.inference_mode()
def measure(model, cache_kind: str, context: int, steps: int, warmup: int, chunk: int, device):
    from transformers import DynamicCache

    from hf_hilbert_attn import PatternCache, prefill

    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    cache = PatternCache(model) if cache_kind == "pattern" else DynamicCache(config=model.config)
    cache = prefill(model, ids, chunk_tokens=chunk, cache=cache)
    tok = ids[:, -1:]
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    del cache
    torch.cuda.empty_cache()
    return 1000 * times[len(times) // 2]  # median ms per token


@torch.inference_mode()
def measure_static(model, context: int, steps: int, warmup: int, device):
    """ms per new token of ``generate()`` with a StaticCache, which Transformers compiles
    ("reduce-overhead": CUDA graphs): the median time between consecutive steps (a logits
    processor synchronises and reads the clock at each), after a first ``generate()`` that
    compiles and records and ``warmup`` steps of the measured one. Also returns the graph breaks
    torch.compile took."""
    from torch._dynamo.utils import counters
    from transformers import LogitsProcessor, LogitsProcessorList, StaticCache

    from hf_hilbert_attn.integrations.cache import cache_kwarg

    class Clock(LogitsProcessor):
        def __init__(self):
            self.at = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize(device)
            self.at.append(time.perf_counter())
            return scores

    ids = torch.randint(3, model.config.vocab_size, (1, context), device=device)
    n = warmup + steps + 1
    cache = StaticCache(config=model.config, max_cache_len=context + n)
    counters.clear()
    for clock in (Clock(), Clock()):
        cache.reset()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]),
                       **{cache_kwarg(model): cache})
    gaps = sorted(b - a for a, b in zip(clock.at[warmup:], clock.at[warmup + 1:]))
    del cache
    torch.cuda.empty_cache()
    return 1000 * gaps[len(gaps) // 2], sum(counters["graph_break"].values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1b", "135m"])
    p.add_argument("--contexts", nargs="+", type=_tokens, default=[4096, 32768])
    p.add_argument("--methods", nargs="+",
                   default=["sdpa", "sdpa-flash", "default", "default+kv0"])
    p.add_argument("--caches", nargs="+", default=["dynamic", "pattern"],
                   choices=["dynamic", "pattern", "static"],
                   help="static: generate() with a StaticCache, compiled with CUDA graphs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=_tokens, default=16384)
    p.add_argument("--before", action="store_true",
                   help="also the hilbert_dilated rows without the decode plan (same process)")
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    import hf_hilbert_attn.integrations.transformers as tf

    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    rows = []
    planned = tf.decodes
    for shape in args.shapes:
        for method in args.methods:
            model = build(shape, method, torch.bfloat16, device)
            variants = ["plan"] + (["before"] if args.before and not method.startswith("sdpa") else [])
            for variant in variants:
                tf.decodes = planned if variant == "plan" else (lambda *a: False)
                for cache in args.caches:
                    if cache == "pattern" and method.startswith("sdpa"):
                        continue
                    for context in args.contexts:
                        try:
                            with _backends(method):
                                ms, breaks = measure_static(
                                    model, context, args.steps, args.warmup, device) \
                                    if cache == "static" else (measure(
                                        model, cache, context, args.steps, args.warmup,
                                        args.chunk, device), "")
                        except torch.OutOfMemoryError:
                            ms, breaks = float("nan"), ""
                            torch.cuda.empty_cache()
                        row = dict(gpu=gpu, shape=shape, method=method, variant=variant,
                                   cache=cache, context=context, ms_per_token=round(ms, 3),
                                   graph_breaks=breaks)
                        rows.append(row)
                        print(",".join(str(v) for v in row.values()), flush=True)
            tf.decodes = planned
            del model
            torch.cuda.empty_cache()
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
