"""Helpers shared by the benchmarks: timing, memory, GPU tagging, CSV / PNG / markdown output.

Kept free of anything attention-specific so every benchmark can reuse it.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

from ..evaluation import report


# ----------------------------------------------------------------------------- device / naming
def device_name(device) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, ``"cpu"`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def sanitize(name: str) -> str:
    """A file-name-safe tag: ``"NVIDIA H100 80GB HBM3"`` → ``"NVIDIA_H100_80GB_HBM3"``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def output_paths(out_dir, stem: str, device, tag: str = "") -> Dict[str, Path]:
    """``{"csv": ..., "png": ...}`` under ``out_dir``, named ``<stem>_<gpu>[_<tag>]``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"{stem}_{sanitize(device_name(device))}" + (f"_{sanitize(tag)}" if tag else "")
    return {"csv": out_dir / f"{name}.csv", "png": out_dir / f"{name}.png"}


def environment(device) -> Dict[str, str]:
    """Columns every benchmark row carries: the card and the library versions."""
    env = {"gpu": device_name(device), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "none"
    return env


def parse_size(text: str) -> int:
    """``"16K"`` → 16384, ``"1M"`` → 1048576, ``"3000"`` → 3000 (binary K/M/G): the commands'
    one length parser, :func:`hf_hilbert_attn.tools.evaluation._args.parse_length`.

    Raises:
        ValueError: for anything else, naming the text.
    """
    from ..evaluation._args import LengthError, parse_length

    n = parse_length(text)
    if n < 0:
        raise LengthError(f"expected a length like 4096, 4K or 1M, got {text!r}")
    return n


def fmt_size(n: int) -> str:
    """16384 → ``"16K"``, 1048576 → ``"1M"``, 3000 → ``"3000"``."""
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- timing / memory
def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], object], device, *, warmup_ms: float = 25, rep_ms: float = 100,
             grad_to_none: Optional[Sequence[torch.Tensor]] = None, min_reps: int = 3) -> float:
    """Median milliseconds of ``fn()``.

    CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, warm-up and repeat
    budgets in milliseconds); a function slower than ``rep_ms / min_reps`` is instead timed
    ``min_reps`` times with CUDA events after one untimed call (its inputs dwarf the L2). CPU: wall clock after one warm-up call, at least ``min_reps`` runs.
    ``grad_to_none`` tensors get ``.grad = None`` before every run, so backward timings don't
    include gradient accumulation.
    """
    if torch.device(device).type == "cuda":
        import triton.testing

        # One timed call first: for a slow function do_bench would still make its five
        # estimate runs plus warm-up for a single measured one, so time min_reps calls directly.
        est = _event_ms(fn, grad_to_none)
        if est * min_reps >= rep_ms:
            return float(statistics.median(_event_ms(fn, grad_to_none) for _ in range(min_reps)))
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             grad_to_none=grad_to_none, return_mode="median"))
    times = []

    def once():
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    first = once()
    n = max(min_reps, int(rep_ms / max(first, 1e-3)))
    for _ in range(min(n, 1000)):
        times.append(once())
    return float(statistics.median(times))


def _event_ms(fn, grad_to_none) -> float:
    for t in grad_to_none or ():
        t.grad = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def peak_memory_bytes(fn: Callable[[], object], device) -> Dict[str, int]:
    """Run ``fn`` once and report memory: ``{"before", "peak", "extra"}`` in bytes.

    ``peak`` is ``torch.cuda.max_memory_allocated`` after a reset just before the call (it
    includes every tensor alive before, e.g. the inputs); ``extra = peak - before`` is what the
    call itself needed at its high point. Zeros on CPU (not tracked).
    """
    device = torch.device(device)
    if device.type != "cuda":
        fn()
        return {"before": 0, "peak": 0, "extra": 0}
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"before": before, "peak": peak, "extra": peak - before}


def is_oom(exc: BaseException) -> bool:
    """True for CUDA / allocator out-of-memory errors, however the library phrased them."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "can't allocate memory" in text or "cudnn_status_alloc" in text)


def short_error(exc: BaseException, limit: int = 160) -> str:
    """One line for a CSV cell: the exception type and the start of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"


def free_memory(device=None) -> None:
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or not math.isfinite(ms) or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------- output
def write_csv(rows: List[dict], path) -> Path:
    """Write dict rows (union of keys, first-seen order) to ``path``; NaN as an empty cell."""
    return report.write_csv(rows, path, nan="")


def markdown_table(rows: Iterable[dict], columns: Sequence[tuple]) -> str:
    """``columns``: ``(header, key, format)``; format like ``"{:.2f}"`` or ``None`` for str()."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, f in columns:
            v = row.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("–")
            elif f is not None and isinstance(v, (int, float)):
                cells.append(f.format(v))
            else:
                cells.append(str(v).replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_panels(rows: List[dict], path, *, panel_key: str, series_key: str, x_key: str,
                y_key: str, title: str, xlabel: str, ylabel: str, logx: bool = True,
                logy: bool = False) -> Path:
    """One subplot per distinct ``panel_key`` value, one line per ``series_key``; PNG via Agg.

    Rows whose ``y_key`` is missing (failed / unavailable) are left out of their line. The
    legend sits under the panels and the title above them, both inside the saved image
    (constrained layout, ``bbox_inches="tight"``), whatever the number of panels.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = list(dict.fromkeys(r[panel_key] for r in rows))
    n = max(1, len(panels))
    ncols = min(4, n)
    nrows = -(-n // ncols)
    width = max(4.6 * ncols, 7.0)  # room for the title and a legend of two columns
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.6 * nrows + 1.2), squeeze=False,
                             layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        sub = [r for r in rows if r[panel_key] == panel]
        for series in dict.fromkeys(r[series_key] for r in sub):
            pts = sorted((r[x_key], r[y_key]) for r in sub
                         if r[series_key] == series and isinstance(r.get(y_key), (int, float))
                         and math.isfinite(r[y_key]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=series)
        ax.set_title(str(panel), fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
            xs = sorted({r[x_key] for r in sub if isinstance(r.get(x_key), int)})
            if xs:
                ax.set_xticks(xs)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_size(int(v))))
                ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        if logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        ncol = max(1, min(len(labels), int(width // 3.4)))
        fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(width * 11))), fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def load_pattern(spec: str) -> tuple:
    """``(name, pattern)`` of a shipped name (``longnet_lm``), a YAML path or an inline
    ``W1,W2:R1,R2`` spec; an unknown one is an ``InputError`` naming the choices."""
    from ..evaluation._args import resolve_pattern

    return resolve_pattern(spec)
