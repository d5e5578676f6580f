"""Results of the eval and the benchmark as markdown tables, CSV and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional, Sequence

__all__ = ["write_csv", "read_eval_csv", "markdown_table", "eval_markdown", "write_eval_report",
           "plot_perplexity", "plot_passkey_heatmap"]


def write_csv(rows: Sequence[Dict], path, nan: str = "nan") -> Path:
    """Write ``rows`` (dicts; the union of their keys, in first-seen order) to ``path``: floats
    to 6 significant digits, NaN as ``nan``, None as an empty cell."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: "OrderedDict[str, None]" = OrderedDict()
    for r in rows:
        for k in r:
            fields.setdefault(k, None)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt_csv(v, nan) for k, v in r.items()})
    return path


_EVAL_INTS = ("length", "stride", "scored_tokens", "processed_tokens")
_EVAL_FLOATS = ("depth", "value", "seconds", "tokens_per_s", "peak_mem_mb")


def read_eval_csv(path) -> list:
    """The rows of an eval's ``results.csv`` with numbers converted back (empty cells stay
    ``""``), as :func:`hf_hilbert_attn.tools.evaluation.run_eval` made them."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for keys, kind in ((_EVAL_INTS, int), (_EVAL_FLOATS, float)):
            for k in keys:
                if r.get(k, "") != "":
                    r[k] = kind(float(r[k])) if kind is int else float(r[k])
    return rows


def _fmt_csv(v, nan: str):
    if isinstance(v, float):
        return nan if math.isnan(v) else f"{v:.6g}"
    return v


def markdown_table(header: Sequence[str], body: Sequence[Sequence]) -> str:
    """A GitHub markdown table; floats get 4 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def _methods(rows):
    return list(OrderedDict.fromkeys(r["method"] for r in rows))


def eval_markdown(rows: Sequence[Dict], notes: Sequence[str] = (), title: str = "") -> str:
    """The eval's tables: perplexity per length, passkey accuracy per length (mean over depths)
    and per depth, then tokens/s and peak memory per (method, task, length)."""
    parts = [f"# Long-context eval: {title}" if title else "# Long-context eval"]
    ppl = [r for r in rows if r["task"] == "perplexity"]
    pk = [r for r in rows if r["task"] == "passkey"]
    if ppl:
        lengths = sorted({r["length"] for r in ppl})
        table = {(r["method"], r["length"]): r for r in ppl}
        body = [[m] + [table[(m, L)]["value"] if (m, L) in table else "" for L in lengths]
                for m in _methods(ppl)]
        r0 = ppl[0]
        parts.append(f"\n## Perplexity by context length (strided windows, stride "
                     f"{'L/2' if r0['stride'] == r0['length'] // 2 else r0['stride']}; each token "
                     f"scored once: {r0['scored_tokens']} tokens)\n")
        parts.append(markdown_table(["method"] + [str(L) for L in lengths], body))
    if pk:
        lengths = sorted({r["length"] for r in pk})
        depths = sorted({r["depth"] for r in pk})
        body = []
        for m in _methods(pk):
            row = [m]
            for L in lengths:
                cells = [r for r in pk if r["method"] == m and r["length"] == L]
                c = sum(r["value"] * r["scored_tokens"] for r in cells)
                n = sum(r["scored_tokens"] for r in cells)
                row.append(c / n if n else "")
            body.append(row)
        parts.append(f"\n## Passkey retrieval accuracy by context length (mean over depths "
                     f"{', '.join(f'{d:g}' for d in depths)}; {pk[0]['scored_tokens']} trials "
                     f"per depth)\n")
        parts.append(markdown_table(["method"] + [str(L) for L in lengths], body))
        cell = {(r["method"], r["depth"], r["length"]): r["value"] for r in pk}
        body = [[m, f"{d:g}"] + [cell.get((m, d, L), "") for L in lengths]
                for m in _methods(pk) for d in depths]
        parts.append("\nBy needle depth:\n")
        parts.append(markdown_table(["method", "depth"] + [str(L) for L in lengths], body))
    speed, seen = [], set()
    for r in rows:
        key = (r["method"], r["task"], r["length"])
        if key in seen:
            continue
        seen.add(key)
        speed.append([r["method"], r["task"], r["length"], r["tokens_per_s"], r["peak_mem_mb"]])
    if speed:
        kind = rows[0]["mem_kind"]
        parts.append(f"\n## Speed and memory ({rows[0]['device']}, {rows[0]['dtype']}; memory = "
                     f"{'CUDA max allocated' if kind == 'cuda_max_allocated' else 'peak process RSS above the start, sampled'})\n")
        parts.append(markdown_table(["method", "task", "length", "tokens/s", "peak MiB"], speed))
    if notes:
        parts.append("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    return "\n".join(parts) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_style(i: int) -> Dict:
    """Matplotlib kwargs for the ``i``-th curve: cycling line styles and markers."""
    return dict(linestyle=("-", "--", ":", "-.")[i % 4], marker="osD^v"[i % 5],
                markersize=max(3.0, 8.0 - 1.5 * i), linewidth=max(1.0, 2.5 - 0.5 * i))


def plot_perplexity(rows: Sequence[Dict], path, title: str = "") -> Optional[Path]:
    """Perplexity vs context length, one line per method (log2 x axis)."""
    ppl = [r for r in rows if r["task"] == "perplexity"]
    if not ppl:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, m in enumerate(_methods(ppl)):
        pts = sorted((r["length"], r["value"]) for r in ppl if r["method"] == m)
        # distinct line styles and shrinking markers keep coinciding curves (sdpa vs the dense
        # pattern) visible
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, **line_style(i))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title or "perplexity vs context length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_passkey_heatmap(rows: Sequence[Dict], path, title: str = "") -> Optional[Path]:
    """Passkey accuracy heat map (depth × length), one panel per method."""
    pk = [r for r in rows if r["task"] == "passkey"]
    if not pk:
        return None
    plt = _plt()
    methods = _methods(pk)
    lengths = sorted({r["length"] for r in pk})
    depths = sorted({r["depth"] for r in pk})
    fig, axes = plt.subplots(1, len(methods), figsize=(1.2 + 0.9 * len(lengths) * len(methods)
                                                       + 1.0 * len(methods), 1.6 + 0.5 * len(depths)),
                             squeeze=False)
    for col, (ax, m) in enumerate(zip(axes[0], methods)):
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for r in pk:
            if r["method"] == m:
                grid[depths.index(r["depth"])][lengths.index(r["length"])] = r["value"]
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                v = grid[i][j]
                ax.text(j, i, "-" if math.isnan(v) else f"{v:.2f}", ha="center", va="center",
                        fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length")
        if col == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(m, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_eval_report(rows: Sequence[Dict], out_dir, *, notes=(), plots=True, title="") -> Dict:
    """Write ``results.csv``, ``results.md`` and (if ``plots``) ``perplexity.png`` and
    ``passkey_heatmap.png`` into ``out_dir``.

    Returns:
        ``{"markdown": str, "files": {name: Path}}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = eval_markdown(rows, notes, title)
    files = {"csv": write_csv(rows, out / "results.csv")}
    (out / "results.md").write_text(md)
    files["markdown"] = out / "results.md"
    if plots:
        p = plot_perplexity(rows, out / "perplexity.png", title)
        if p:
            files["perplexity_png"] = p
        p = plot_passkey_heatmap(rows, out / "passkey_heatmap.png", title)
        if p:
            files["passkey_png"] = p
    return {"markdown": md, "files": files}
