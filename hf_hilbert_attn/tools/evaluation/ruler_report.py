"""The RULER-style tasks' results (:mod:`.ruler` makes and scores the prompts): means per group,
the per-prompt CSV, and the heatmaps of score by task and length."""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .report import _plt
from .ruler import DEPTH_FREE

__all__ = ["summarize", "write_ruler_csv", "plot_heatmap", "plot_ruler", "CSV_FIELDS"]


def summarize(rows: Sequence[Dict], by: Sequence[str] = ("task", "length")) -> List[Dict]:
    """Mean ``score`` and prompt count per group of ``by`` (groups in first-seen order)."""
    groups: "OrderedDict[tuple, List[float]]" = OrderedDict()
    for r in rows:
        key = tuple("" if isinstance(r[k], float) and math.isnan(r[k]) else r[k] for k in by)
        groups.setdefault(key, []).append(float(r["score"]))
    return [dict(zip(by, k), score=sum(v) / len(v), n=len(v)) for k, v in groups.items()]


CSV_FIELDS = ["task", "length", "depth", "index", "score", "correct", "items", "expected",
              "predicted", "prompt_tokens"]


def write_ruler_csv(rows: Sequence[Dict], path, extra: Sequence[str] = ()) -> Path:
    """The per-prompt rows as CSV (columns :data:`CSV_FIELDS` plus ``extra``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(extra) + [f for f in CSV_FIELDS if f not in extra]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if isinstance(r.get(k), float) and math.isnan(r[k]) else r.get(k))
                        for k in fields})
    return path


# ----------------------------------------------------------------------------- plots
def plot_heatmap(matrix: Sequence[Sequence[float]], row_labels: Sequence[str],
                 col_labels: Sequence[str], path, title: str = "", ax=None) -> Optional[Path]:
    """Scores in [0, 1] as a red-to-green grid with each value written in its cell (NaN blank).
    Draws into ``ax`` when given (returns None), else saves a figure to ``path``."""

    plt = _plt()
    own = ax is None
    if own:
        rotated = 1.2 if len(col_labels) > 6 else 0.0  # room for slanted column labels
        fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(col_labels),
                                        1.0 + rotated + 0.45 * len(row_labels)))
    data = torch.tensor([[float("nan") if v is None else float(v) for v in row]
                         for row in matrix]).numpy()
    ax.imshow(data, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            if not math.isnan(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(col_labels)), col_labels, rotation=45 if len(col_labels) > 6 else 0,
                  ha="right" if len(col_labels) > 6 else "center")
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.set_title(title, fontsize=10)
    if not own:
        return None
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _length_label(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def plot_ruler(rows: Sequence[Dict], out_dir, title: str = "") -> List[Path]:
    """``ruler_tasks.png`` (task × length) and ``ruler_depths.png`` (depth × length per task
    that has depths)."""

    out_dir = Path(out_dir)
    tasks = list(OrderedDict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cell = {(s["task"], s["length"]): s["score"] for s in summarize(rows)}
    paths = [plot_heatmap([[cell.get((t, L)) for L in lengths] for t in tasks], tasks,
                          [_length_label(L) for L in lengths], out_dir / "ruler_tasks.png",
                          title or "RULER-style retrieval (fraction of items recalled)")]
    deep = [t for t in tasks if t not in DEPTH_FREE]
    if deep:
        plt = _plt()
        fig, axes = plt.subplots(1, len(deep), figsize=(0.5 + 2.6 * len(deep), 3.2),
                                 squeeze=False)
        by_depth = {(s["task"], s["depth"], s["length"]): s["score"]
                    for s in summarize(rows, ("task", "depth", "length"))}
        for ax, t in zip(axes[0], deep):
            ds = sorted({r["depth"] for r in rows if r["task"] == t})
            plot_heatmap([[by_depth.get((t, d, L)) for L in lengths] for d in ds],
                         [f"{d:g}" for d in ds], [_length_label(L) for L in lengths], None,
                         t, ax=ax)
        axes[0][0].set_ylabel("depth")
        fig.tight_layout()
        p = out_dir / "ruler_depths.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
