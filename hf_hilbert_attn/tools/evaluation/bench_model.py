"""End-to-end model benchmark: forward + backward of a causal LM with gradient checkpointing,
``sdpa`` vs ``hilbert_dilated``, tokens/s and peak memory per sequence length, and the longest
sequence each can run.

Preset ``1b`` is a Llama-3.2-1B-shaped model (random init, bf16: 16 layers, hidden 2048,
32 heads × 64, 8 KV heads, intermediate 8192, vocab 128256) at 16K–128K tokens on one GPU;
preset ``tiny`` is a CPU smoke test. Entry points: ``hf-hilbert-attn bench model`` and
``examples/benchmarks/bench_model.py`` (both call :func:`main`).

Memory outside attention. With ``--loss full`` the model's own loss materialises the logits
``[S, V]`` (bf16, then a float32 copy and its gradient: about ``S·V·10`` bytes; 128K tokens ×
128256 = 157 GiB), which alone caps the length far below what attention allows. The default
``--loss chunked`` takes the final hidden states and computes the cross-entropy ``--loss-chunk``
tokens at a time, each chunk checkpointed so its logits are recomputed in backward, so the
logits cost ``chunk·V·10`` bytes whatever ``S`` is. What then remains per token is the
checkpointed input of every layer (``layers·S·hidden·2`` bytes) and the one layer recomputed in
backward (MLP ``S·intermediate·2`` bytes × ~4 live tensors, q/k/v/o); :func:`memory_estimates`
prints these per length so the limit can be read off.
"""

from __future__ import annotations

import argparse
import gc
import logging
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from hf_hilbert_attn.long_context import offload_checkpoints, tile_mlp
from hf_hilbert_attn.training import enable_checkpointing, liger_available, lm_loss

from ..models import MODEL_SHAPES, compile_layers

from ._args import (InputError, check_device, length_type, positive_int, report_input_errors,
                    results_dir, show_progress)

_length_arg = length_type("sequence length")

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "build_model", "train_step", "memory_estimates", "run_benchmark",
           "find_max_length", "main"]

PRESETS = {
    "1b": dict(
        model=MODEL_SHAPES["1b"], gpu=True,
        lengths=[16384, 32768, 65536, 131072], dtype="bfloat16", pattern="longnet_lm",
        warmup=1, iters=2, max_len_start=131072, max_len_step=16384,
        plan="Llama-3.2-1B shape (random init, bf16) at 16K, 32K, 64K and 128K tokens, sdpa vs "
             "hilbert_dilated:longnet_lm; needs a CUDA GPU (minutes)",
    ),
    "tiny": dict(
        model=MODEL_SHAPES["tiny"], gpu=False,
        lengths=[128, 256], dtype="float32", pattern="tiny",
        warmup=1, iters=1, max_len_start=256, max_len_step=128,
        plan="a 2-layer hidden-64 model at 128 and 256 tokens: a CPU smoke test of the "
             "pipeline (seconds; its timings are noise)",
    ),
}

# short sequences, small heads: the quality study's model shape
PRESETS["135m"] = {**PRESETS["1b"], "model": MODEL_SHAPES["135m"], "lengths": [4096, 8192],
                   "pattern": "default", "warmup": 2, "iters": 5, "max_len_start": 65536,
                   "plan": "SmolLM2-135M shape (random init, bf16) at 4K and 8K tokens, sdpa vs "
                           "hilbert_dilated:default; needs a CUDA GPU"}

OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
                    torch.cuda.OutOfMemoryError})


def build_model(model_kwargs: Dict, attn_implementation: str, dtype: torch.dtype,
                device: torch.device, pattern=None, seed: int = 0, compile: bool = False,
                tiled_mlp: int = 0, offload: bool = False):
    """A random-initialised ``LlamaForCausalLM`` in train mode with gradient checkpointing
    (decoder layers compiled with ``compile``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(max_position_embeddings=1 << 22, use_cache=False, **model_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype)
    if attn_implementation != "sdpa":
        model.set_attn_implementation(attn_implementation)
    if pattern is not None:
        import hf_hilbert_attn

        hf_hilbert_attn.configure(model, pattern)
    enable_checkpointing(model)
    tile_mlp(model, tiled_mlp)  # 0: plain MLP
    if offload:
        offload_checkpoints(model)
    if compile:
        compile_layers(model)
    model.train()
    return model


def train_step(model, input_ids: torch.Tensor, loss_mode: str = "chunked",
               loss_chunk: int = 2048) -> float:
    """One forward + backward on ``input_ids`` ``[B, S]`` (next-token loss); returns the loss."""
    if loss_mode == "full":
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    else:
        base = getattr(model, model.base_model_prefix)
        hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
        labels = torch.full_like(input_ids, -100)
        labels[:, :-1] = input_ids[:, 1:]
        loss = lm_loss(hidden, model.get_output_embeddings().weight, labels, loss_chunk,
                       backend="liger" if loss_mode == "liger" else "chunked")
    loss.backward()
    return float(loss.detach())


def memory_estimates(model_kwargs: Dict, seq_len: int, dtype_bytes: int = 2,
                     loss_chunk: int = 2048) -> Dict[str, float]:
    """GiB used outside attention for one forward + backward at ``seq_len`` tokens (estimates).

    Returns a dict: ``params+grads``, ``full_loss_logits`` (``S·V·10`` bytes: bf16 logits, a
    float32 copy, its gradient), ``chunked_loss_logits``, ``checkpointed_inputs``
    (layers·S·hidden), ``recomputed_layer`` (one layer's MLP and q/k/v/o tensors in backward).
    """
    m = model_kwargs
    H, I, V, L = m["hidden_size"], m["intermediate_size"], m["vocab_size"], m["num_hidden_layers"]
    D = m.get("head_dim") or H // m["num_attention_heads"]
    qkvo = m["num_attention_heads"] * D * 2 + 2 * m["num_key_value_heads"] * D
    params = V * H * (1 if m.get("tie_word_embeddings") else 2) + L * (H * qkvo + 3 * H * I)
    gib = 2.0 ** 30
    return {
        "params+grads": 2 * params * dtype_bytes / gib,
        "full_loss_logits": seq_len * V * (dtype_bytes + 8) / gib,
        "chunked_loss_logits": min(seq_len, loss_chunk) * V * (dtype_bytes + 8) / gib,
        "checkpointed_inputs": L * seq_len * H * dtype_bytes / gib,
        "recomputed_layer": seq_len * (4 * I + qkvo + 4 * H) * dtype_bytes / gib,
    }


def _cleanup(model, device):
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _try_step(model, seq_len, device, vocab, loss_mode, loss_chunk, reps=1):
    """Run ``reps`` steps; returns (seconds per step, peak bytes, loss) or raises OOM."""
    ids = torch.randint(0, vocab, (1, seq_len), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    from .measure import Meter

    with Meter(device) as m:
        for _ in range(reps):
            loss = train_step(model, ids, loss_mode, loss_chunk)
            model.zero_grad(set_to_none=True)
    return m.seconds / reps, m.peak_bytes, loss


def measure(model, seq_len, device, vocab, *, warmup, iters, loss_mode, loss_chunk) -> Dict:
    """Tokens/s and peak memory of forward+backward at ``seq_len``; status ``ok`` or ``OOM``."""
    oom = False
    try:
        if warmup:
            _try_step(model, seq_len, device, vocab, loss_mode, loss_chunk, reps=warmup)
        sec, peak, loss = _try_step(model, seq_len, device, vocab, loss_mode, loss_chunk,
                                    reps=iters)
    except OOM_ERRORS:
        oom = True
    if oom:  # outside the except block, so the traceback's tensors are already released
        _cleanup(model, device)
        return dict(status="OOM", step_s=float("nan"), tokens_per_s=float("nan"),
                    peak_mem_gib=float("nan"), loss=float("nan"))
    _cleanup(model, device)
    return dict(status="ok", step_s=sec, tokens_per_s=seq_len / sec, peak_mem_gib=peak / 2**30,
                loss=loss)


def find_max_length(model, device, vocab, *, start: int, step: int, cap: int,
                    max_trial_s: float, loss_mode: str, loss_chunk: int,
                    progress=None) -> Dict:
    """Longest sequence (a multiple of ``step``) whose forward + backward runs.

    Doubles from ``start`` until a step runs out of memory, reaches ``cap``, or its time,
    extrapolated quadratically from the last success, would exceed ``max_trial_s``; then
    bisects between the last success and the first failure to ``step`` tokens.

    Returns:
        ``max_len`` (0 if even ``start`` fails), ``limited_by`` (``"OOM"``, ``"cap"`` or
        ``"time"``), ``peak_mem_gib`` and ``step_s`` at ``max_len``, and ``trials``.
    """
    trials = []

    def attempt(n):
        r = measure(model, n, device, vocab, warmup=0, iters=1, loss_mode=loss_mode,
                    loss_chunk=loss_chunk)
        trials.append((n, r["status"], r["step_s"]))
        if progress is not None:
            progress.set_postfix_str(f"{n}: {r['status']}")
            progress.update(1)
        return r

    best, best_r, fail = 0, None, None
    n = start
    limited_by = "cap"
    while True:
        if best_r is not None and best_r["step_s"] * (n / best) ** 2 > max_trial_s:
            limited_by = "time"
            break
        r = attempt(n)
        if r["status"] != "ok":
            fail, limited_by = n, "OOM"
            break
        best, best_r = n, r
        if n >= cap:
            break
        n = min(cap, n * 2)
    if fail is not None:
        lo, hi = best, fail
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            if mid <= lo:
                break
            if best_r is not None and best_r["step_s"] * (mid / best) ** 2 > max_trial_s:
                break
            r = attempt(mid)
            if r["status"] == "ok":
                lo, best, best_r = mid, mid, r
            else:
                hi = mid
    return dict(max_len=best, limited_by=limited_by,
                peak_mem_gib=best_r["peak_mem_gib"] if best_r else float("nan"),
                step_s=best_r["step_s"] if best_r else float("nan"), trials=trials)


def device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def run_benchmark(args) -> Dict:
    """Run the benchmark for parsed ``args`` (see :func:`add_bench_arguments`); writes the CSVs,
    the PNG and ``bench_model_<gpu>.md`` into ``args.out_dir`` and returns them."""
    from ..progress import progress_bar as tqdm  # a bar on a terminal, else lines

    from . import report
    from ._args import resolve_pattern

    preset = PRESETS[args.preset]
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or preset["dtype"])
    if args.loss == "liger" and not (device.type == "cuda" and liger_available()):
        raise InputError("--loss liger needs a CUDA device and Liger-Kernel "
                         "(pip install liger-kernel)")
    if args.tiled_mlp < 0:
        raise InputError(f"--tiled-mlp must be >= 0 (0: off), got {args.tiled_mlp}")
    lengths = args.lengths or preset["lengths"]
    model_kwargs = dict(preset["model"])
    pattern_label, pattern = resolve_pattern(args.pattern or preset["pattern"])
    impls = list(args.impls)
    notes = []
    if device.type == "cpu":
        notes.append("CPU timings: step times of this size swing by several times between runs, "
                     "so the speed and memory ratios are not shown (the columns say n/a); time "
                     "on a GPU (--preset 1b) for numbers that mean something")
    tag = device_tag(device)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows: List[Dict] = []
    max_rows: List[Dict] = []
    for impl in impls:
        label = impl if impl == "sdpa" else f"{impl}:{pattern_label}"
        model = build_model(model_kwargs, impl, dtype, device,
                            pattern if impl != "sdpa" else None, seed=args.seed,
                            compile=args.compile, tiled_mlp=args.tiled_mlp,
                            offload=args.offload_checkpoints)
        bars = not args.no_progress  # progress_bar: a bar on a terminal, else lines
        bar = tqdm(lengths, desc=f"bench {label}", disable=not bars)
        for S in bar:
            r = measure(model, S, device, model_kwargs["vocab_size"], warmup=args.warmup
                        if args.warmup is not None else preset["warmup"],
                        iters=args.iters or preset["iters"], loss_mode=args.loss,
                        loss_chunk=args.loss_chunk)
            rows.append(dict(gpu=gpu_name, preset=args.preset, method=label, seq_len=S,
                             dtype=str(dtype).replace("torch.", ""), loss_mode=args.loss,
                             compiled=bool(args.compile), tiled_mlp=args.tiled_mlp,
                             offload_checkpoints=bool(args.offload_checkpoints), **r))
        if args.max_len:
            max_rows.append(_max_len_row(model, device, model_kwargs["vocab_size"], args, preset,
                                         label, gpu_name, bars))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    _add_ratios(rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"csv": report.write_csv(rows, out / f"bench_model_{args.preset}_{tag}.csv")}
    if max_rows:
        files["max_len_csv"] = report.write_csv(
            max_rows, out / f"bench_model_{args.preset}_maxlen_{tag}.csv")
    md = _markdown(rows, max_rows, model_kwargs, lengths, args, gpu_name, notes)
    files["markdown"] = out / f"bench_model_{args.preset}_{tag}.md"
    files["markdown"].write_text(md)
    if not args.no_plots:
        files["png"] = _plot(rows, max_rows, out / f"bench_model_{args.preset}_{tag}.png",
                             f"{args.preset} model, fwd+bwd, grad ckpt — {gpu_name}")
    return dict(rows=rows, max_rows=max_rows, markdown=md, files=files)


def _max_len_row(model, device, vocab_size: int, args, preset: Dict, label: str,
                 gpu_name: str, bars: bool) -> Dict:
    """The longest sequence one fwd+bwd step of ``model`` runs (``--max-len``)."""
    from ..progress import progress_bar as tqdm  # a bar on a terminal, else lines

    with tqdm(desc=f"max length {label}", disable=not bars) as pbar:
        m = find_max_length(
            model, device, vocab_size,
            start=args.max_len_start or preset["max_len_start"],
            step=args.max_len_step or preset["max_len_step"], cap=args.max_len_cap,
            max_trial_s=args.max_trial_seconds, loss_mode=args.loss,
            loss_chunk=args.loss_chunk, progress=pbar)
    return dict(gpu=gpu_name, preset=args.preset, method=label,
                max_len=m["max_len"], limited_by=m["limited_by"],
                peak_mem_gib=m["peak_mem_gib"], step_s=m["step_s"],
                loss_mode=args.loss,
                trials=" ".join(f"{n}:{s}" for n, s, _ in m["trials"]))


def _add_ratios(rows: List[Dict]) -> None:
    """Tokens/s and peak memory as ratios to sdpa at the same length."""
    base = {r["seq_len"]: r for r in rows if r["method"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        b = base.get(r["seq_len"])
        r["speedup_vs_sdpa"] = (r["tokens_per_s"] / b["tokens_per_s"]
                                if b and r["status"] == "ok" else float("nan"))
        r["memory_vs_sdpa"] = (r["peak_mem_gib"] / b["peak_mem_gib"]
                               if b and r["status"] == "ok" else float("nan"))


def _markdown(rows, max_rows, model_kwargs, lengths, args, gpu_name, notes) -> str:
    from .report import markdown_table

    parts = [f"# bench_model ({args.preset}) on {gpu_name}, forward+backward, gradient "
             f"checkpointing, loss={args.loss}{', decoder layers compiled' if args.compile else ''}\n"]
    cpu = any(r["gpu"] == "cpu" for r in rows)
    body = [[r["method"], r["seq_len"], r["status"], r["tokens_per_s"], r["step_s"],
             r["peak_mem_gib"]] + (["n/a", "n/a"] if cpu else
                                   [r["speedup_vs_sdpa"], r["memory_vs_sdpa"]]) for r in rows]
    parts.append(markdown_table(["method", "tokens", "status", "tokens/s", "s/step",
                                 "peak GiB", "speed vs sdpa", "memory vs sdpa"], body))
    if max_rows:
        parts.append("\n## Longest sequence (forward+backward)\n")
        parts.append(markdown_table(
            ["method", "max tokens", "limited by", "peak GiB there", "s/step there"],
            [[r["method"], r["max_len"], r["limited_by"], r["peak_mem_gib"], r["step_s"]]
             for r in max_rows]))
    est_lengths = sorted(set(lengths) | {r["max_len"] for r in max_rows if r["max_len"]})
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype or PRESETS[args.preset]["dtype"])).element_size()
    est = [memory_estimates(model_kwargs, S, dtype_bytes, args.loss_chunk) for S in est_lengths]
    keys = list(est[0])
    parts.append("\n## Memory outside attention (estimates, GiB)\n")
    parts.append(markdown_table(["tokens"] + keys,
                                [[S] + [e[k] for k in keys] for S, e in zip(est_lengths, est)]))
    if notes:
        parts.append("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    return "\n".join(parts) + "\n"


def _plot(rows, max_rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    from .report import line_style

    for i, m in enumerate(dict.fromkeys(r["method"] for r in rows)):
        pts = [(r["seq_len"], r["tokens_per_s"], r["peak_mem_gib"]) for r in rows
               if r["method"] == m and r["status"] == "ok"]
        mx = [x["max_len"] for x in max_rows if x["method"] == m]
        lab = m + (f" (max {mx[0]} tokens)" if mx else "")
        a.plot([p[0] for p in pts], [p[1] for p in pts], label=lab, **line_style(i))
        b.plot([p[0] for p in pts], [p[2] for p in pts], label=lab, **line_style(i))
    for ax, yl in ((a, "tokens/s"), (b, "peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def add_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="required: 1b (Llama-3.2-1B shape, GPU), 135m (SmolLM2-135M shape, "
                   "GPU) or tiny (CPU smoke test)")
    p.add_argument("--lengths", nargs="+", type=_length_arg, default=None,
                   help="sequence lengths (default 16k 32k 64k 128k for 1b)")
    p.add_argument("--impls", nargs="+", choices=("sdpa", "hilbert_dilated", "flex_attention",
                                                  "eager"),
                   default=["sdpa", "hilbert_dilated"])
    p.add_argument("--pattern", default=None,
                   help="pattern for hilbert_dilated (default longnet_lm for 1b, tiny for tiny)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--loss", choices=("chunked", "full", "liger"), default="chunked",
                   help="chunked: CE over hidden-state chunks (logits never whole); full: the "
                        "model's own loss over [S, vocab] logits")
    p.add_argument("--loss-chunk", type=positive_int, default=2048)
    p.add_argument("--tiled-mlp", type=int, default=0, metavar="CHUNK",
                   help="run each layer's MLP and its backward CHUNK tokens at a time (0: off)")
    p.add_argument("--offload-checkpoints", action="store_true",
                   help="keep the checkpointed layer inputs in pinned host memory until backward")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every decoder layer (both implementations alike); the "
                   "warm-up steps absorb the compilation, one per length")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=positive_int, default=None)
    p.add_argument("--max-len", action="store_true",
                   help="also search the longest sequence each implementation runs")
    p.add_argument("--max-len-start", type=_length_arg, default=None)
    p.add_argument("--max-len-step", type=_length_arg, default=None)
    p.add_argument("--max-len-cap", type=_length_arg, default=1 << 21)
    p.add_argument("--max-trial-seconds", type=float, default=150.0,
                   help="skip max-length trials whose extrapolated step time exceeds this")
    p.add_argument("--out-dir", default=results_dir("bench_model"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_bench_arguments(argparse.ArgumentParser(
        prog=prog, description="End-to-end forward+backward benchmark: sdpa vs hilbert_dilated."))
    args = parser.parse_args(argv)
    return report_input_errors(lambda: run_from_args(args, parser), parser.prog)


def plan_text() -> str:
    return "; ".join(f"--preset {name}: {p['plan']}" for name, p in sorted(PRESETS.items()))


def run_preset(args, parser, presets, run, usage: str) -> int:
    """The shared tail of ``bench model`` / ``bench generate``: no preset or a bad device or
    pattern is a ``parser.error`` (exit 2); a GPU preset on a machine without CUDA an
    :class:`InputError` naming the preset that runs there; else ``run(args)``, its Markdown
    printed and its files named."""
    if args.preset is None:
        parser.error(usage)
    try:
        check_device(args.device)
        from ._args import resolve_pattern

        resolve_pattern(args.pattern or presets[args.preset]["pattern"])
    except InputError as e:
        parser.error(str(e))
    if presets[args.preset]["gpu"] and args.device == "auto" and not torch.cuda.is_available():
        raise InputError(f"--preset {args.preset} needs a CUDA GPU and torch sees none here; "
                         f"on a CPU run --preset tiny (or force --device cpu)")
    out = run(args)
    print(out["markdown"])
    print(f"wrote {', '.join(str(v) for v in out['files'].values())}")
    return 0


def run_from_args(args, parser) -> int:
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    return run_preset(args, parser, PRESETS, run_benchmark, f"choose what to run: {plan_text()}")
