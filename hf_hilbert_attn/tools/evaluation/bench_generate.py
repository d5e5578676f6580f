"""Generation benchmark: peak memory and tokens/s of ``generate()`` after a long context, with
the bounded :class:`~hf_hilbert_attn.PatternCache` vs Transformers' ``DynamicCache``.

For each context length ``C`` and cache: the first ``C - 1`` tokens are prefilled in chunks of
``--prefill-chunk`` tokens (:func:`~hf_hilbert_attn.prefill`, the same chunking for both caches),
then ``generate()`` continues from the cache for ``--new-tokens`` greedy tokens. Reported: the
prefill's tokens/s, the decode's tokens/s (new tokens / generate time), ms per token (the median
time from one token's logits to the next's, the device synchronised: ``generate()``'s setup and
an odd slow step do not move it), the peak memory of the
whole run (``torch.cuda.max_memory_allocated``), the memory the cache holds at the end and the
keys it stores per layer. A run out of memory is a row with status ``OOM``, not a crash.

Methods, side by side on the same weights: ``hilbert_dilated`` with ``--pattern``; with
``--dense-kv-heads J ...`` also that pattern with those key/value heads dense (as a calibrated
model); with ``--baselines`` also ``sdpa`` as Transformers calls it (torch 2.11 picks cuDNN for
decoding on Hopper) and ``sdpa-flash`` (SDPA without its cuDNN backend), DynamicCache only.

Preset ``1b``: a Llama-3.2-1B-shaped model (random init, bf16: 16 layers, hidden 2048, 32 heads,
8 KV heads), the default pattern, with and without dense key/value head 0, against both SDPA
baselines, contexts 4K to 1M, 32 new tokens. Preset ``tiny``: a CPU smoke test. Entry point:
``hf-hilbert-attn bench generate``.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ._args import InputError, parse_length, positive_int, report_input_errors, results_dir
from .bench_model import OOM_ERRORS, device_tag, run_preset

__all__ = ["PRESETS", "CACHES", "build_model", "measure_generate", "run_benchmark", "main"]

PRESETS = {
    "1b": dict(shape="1b", gpu=True, contexts=[4096, 32768, 131072, 1048576], new_tokens=32,
               prefill_chunk=16384, dtype="bfloat16", pattern="default", dense_kv_heads=[0],
               baselines=["sdpa", "sdpa-flash"]),
    "tiny": dict(shape="tiny", gpu=False, contexts=[96, 160], new_tokens=4, prefill_chunk=40,
                 dtype="float32", pattern="32,64:1,2:sliding:sinks=1", dense_kv_heads=[],
                 baselines=[]),
}
CACHES = ("pattern", "dynamic")
BASELINES = ("sdpa", "sdpa-flash")
# SDPA at 1M tokens: its dense prefill takes minutes; rows past this are skipped
SDPA_MAX_CONTEXT = 1 << 18


def parse_tokens(text: str) -> int:
    """``"131072"``, ``"128k"`` (× 1024) or ``"1m"`` (× 1024²) → int (``_args.parse_length``)."""
    n = parse_length(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"a context needs at least 2 tokens, got {text!r}")
    return n


def build_model(shape: str, dtype: torch.dtype, device: torch.device, pattern, seed: int = 0):
    """A random-initialised ``LlamaForCausalLM`` of ``models.MODEL_SHAPES[shape]`` in eval mode,
    running ``hilbert_dilated`` with ``pattern``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_hilbert_attn
    from hf_hilbert_attn.tools.models import MODEL_SHAPES

    config = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype).eval()
    return hf_hilbert_attn.configure(model, pattern)


def _make_cache(kind: str, model):
    from transformers import DynamicCache

    from hf_hilbert_attn.integrations.cache import PatternCache

    return PatternCache(model) if kind == "pattern" else DynamicCache(config=model.config)


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepClock:
    """A logits processor that notes the time (the device synchronised) at each new token's
    logits and changes nothing."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores

    def ms_per_token(self) -> float:
        """The median ms between consecutive stamps (NaN with fewer than two)."""
        steps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return 1000 * statistics.median(steps) if steps else float("nan")


@torch.inference_mode()
def measure_generate(model, kind: str, context: int, new_tokens: int, prefill_chunk: int,
                     device: torch.device, seed: int = 0) -> Dict:
    """Prefill ``context - 1`` tokens into a ``kind`` cache, then ``generate`` ``new_tokens``;
    a dict of timings and memory, status ``ok`` or ``OOM``."""
    from transformers import LogitsProcessorList

    from hf_hilbert_attn.integrations.cache import cache_kwarg, prefill

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=gen).to(device)
    row = dict(status="OOM", prefill_s=float("nan"), prefill_tokens_per_s=float("nan"),
               decode_s=float("nan"), decode_tokens_per_s=float("nan"), ms_per_token=float("nan"),
               peak_mem_gib=float("nan"), cache_gib=float("nan"), stored_tokens="")
    cache = out = None
    clock = _StepClock(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        cache = prefill(model, ids[:, :-1], chunk_tokens=prefill_chunk,
                        cache=_make_cache(kind, model))
        _sync(device)
        t1 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]),
                             **{cache_kwarg(model): cache})
        _sync(device)
        t2 = time.perf_counter()
    except OOM_ERRORS:
        pass
    if out is not None:
        made = out.shape[1] - context
        row.update(status="ok", prefill_s=t1 - t0, prefill_tokens_per_s=(context - 1) / (t1 - t0),
                   decode_s=t2 - t1, decode_tokens_per_s=made / (t2 - t1),
                   ms_per_token=clock.ms_per_token(),
                   cache_gib=_cache_bytes(cache) / 2 ** 30,
                   stored_tokens=max(layer.keys.shape[-2] for layer in cache.layers))
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    del cache, out, ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_benchmark(args) -> Dict:
    """Run for parsed ``args`` (:func:`add_arguments`); writes ``bench_generate_<preset>_<gpu>``
    ``.csv`` and ``.md`` into ``args.out_dir`` and returns ``rows``, ``markdown``, ``files``."""
    from . import report
    from ._args import resolve_pattern

    preset = PRESETS[args.preset]
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or preset["dtype"])
    contexts = args.contexts or preset["contexts"]
    new_tokens = args.new_tokens or preset["new_tokens"]
    chunk = args.prefill_chunk or preset["prefill_chunk"]
    label, pattern = resolve_pattern(args.pattern or preset["pattern"])
    methods = _methods(args, preset, label, pattern)  # checked before the model is built
    model = build_model(preset["shape"], dtype, device, pattern, seed=args.seed)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: List[Dict] = []
    for method, pat in methods:
        _use(model, pat)
        for kind in args.caches if pat is not None else ["dynamic"]:
            with _sdpa_backends(method):
                if args.warmup:  # kernels compiled, allocator warm: not measured
                    measure_generate(model, kind, min(contexts), 2, chunk, device, args.seed)
                for context in contexts:
                    if pat is None and context > SDPA_MAX_CONTEXT:
                        continue
                    r = measure_generate(model, kind, context, new_tokens, chunk, device,
                                         args.seed)
                    rows.append(dict(gpu=gpu, preset=args.preset, method=method, pattern=label,
                                     cache=kind, context=context, new_tokens=new_tokens,
                                     prefill_chunk=chunk, dtype=str(dtype).replace("torch.", ""),
                                     **r))
                    if not args.quiet:
                        print(f"{method} {kind} context {context}: {r['status']}, "
                              f"{r['ms_per_token']:.4g} ms per token, peak "
                              f"{_peak(r['peak_mem_gib'])}", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_generate_{args.preset}_{device_tag(device)}"
    files = {"csv": report.write_csv(rows, out / f"{stem}.csv")}
    md = _markdown(rows, args.preset, gpu, label, pattern)
    files["markdown"] = out / f"{stem}.md"
    files["markdown"].write_text(md)
    return dict(rows=rows, markdown=md, files=files)


def _methods(args, preset, label, pattern) -> list:
    """``[(method name, pattern or None for SDPA)]`` of a run (module docstring)."""
    from hf_hilbert_attn.tools.models import MODEL_SHAPES

    methods = [(label, pattern)]
    dense = preset["dense_kv_heads"] if args.dense_kv_heads is None else args.dense_kv_heads
    if dense:
        try:
            with_dense = pattern.replace(dense_kv_heads=dense)
            with_dense.check_kv_heads(MODEL_SHAPES[preset["shape"]]["num_key_value_heads"])
        except ValueError as e:
            raise InputError(f"--dense-kv-heads: {e}") from None
        methods.append((f"{label}+kv{','.join(map(str, dense))}", with_dense))
    baselines = preset["baselines"] if args.baselines is None else args.baselines
    return [(b, None) for b in baselines] + methods


def _use(model, pattern) -> None:
    """Switch ``model`` to SDPA (``pattern`` None) or to ``hilbert_dilated`` with ``pattern``."""
    import hf_hilbert_attn

    if pattern is None:
        model.set_attn_implementation("sdpa")
    else:
        hf_hilbert_attn.configure(model, pattern)


def _sdpa_backends(method: str):
    """``sdpa-flash``: SDPA without its cuDNN backend (which plans anew for every key count)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if method != "sdpa-flash":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def _peak(gib: float) -> str:
    """Peak GPU memory as printed; NaN in the CSV (a CPU, a run that failed): not measured."""
    return "not measured" if math.isnan(gib) else f"{gib:.4g} GiB"


def _markdown(rows, preset, gpu, label, pattern) -> str:
    from .report import markdown_table

    body = [[r["method"], r["cache"], r["context"], r["status"], r["ms_per_token"],
             r["prefill_tokens_per_s"], "–" if math.isnan(r["peak_mem_gib"]) else
             r["peak_mem_gib"], r["cache_gib"], r["stored_tokens"]] for r in rows]
    return (f"# bench_generate ({preset}) on {gpu}: generate() after a long context\n\n"
            f"hilbert_dilated:{label} ({pattern}); prefill in chunks of {rows[0]['prefill_chunk']}"
            f" tokens, then {rows[0]['new_tokens']} greedy tokens; `pattern` = PatternCache, "
            f"`dynamic` = DynamicCache.\n\n"
            + markdown_table(["method", "cache", "context", "status", "ms per token",
                              "prefill tokens/s", "peak GiB", "cache GiB", "keys stored per layer"],
                             body) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="required: 1b (Llama-3.2-1B shape, GPU) or tiny (CPU smoke test)")
    p.add_argument("--contexts", nargs="+", type=parse_tokens, default=None,
                   help="context lengths (default 128k 1m for 1b)")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="tokens generated after each context (default 32 for 1b)")
    p.add_argument("--prefill-chunk", type=parse_tokens, default=None,
                   help="tokens per prefill forward (default 16k for 1b)")
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    p.add_argument("--dense-kv-heads", nargs="*", type=int, default=None, metavar="J",
                   help="also the pattern with these key/value heads dense (default: 0 for 1b, "
                        "none for tiny; give none to skip)")
    p.add_argument("--baselines", nargs="*", choices=BASELINES, default=None,
                   help="SDPA rows beside ours (default: both for 1b, none for tiny)")
    p.add_argument("--pattern", default=None,
                   help="hilbert_dilated pattern (default: the shipped default pattern)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unmeasured warm-up run per cache")
    p.add_argument("--out-dir", default=results_dir("bench_generate"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    return p


def run_from_args(args, parser) -> int:
    return run_preset(args, parser, PRESETS, run_benchmark,
                      "choose --preset 1b (GPU: 128K and 1M contexts) or --preset tiny (CPU)")


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog=prog, description="generate() after a long context: PatternCache vs DynamicCache."))
    args = parser.parse_args(argv)
    return report_input_errors(lambda: run_from_args(args, parser), parser.prog)
