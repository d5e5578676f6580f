"""The quality study's report: the tables of ``quality.md`` and the plots ``quality_ppl.png``
and ``quality_passkey.png``, drawn from the rows of ``OUT/quality.csv`` alone (so
``--report-only OUT`` redraws them without a model)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .quality_data import STAGES, TASKS, StudyError, read_rows
from .report import _plt, markdown_table


# ----------------------------------------------------------------------------- report
def _ordered(values) -> List:
    return list(OrderedDict.fromkeys(values))


def _reference(rows) -> Optional[str]:
    """The dense control: the first method that ran with sdpa."""
    return next((r["method"] for r in rows if r["attn_implementation"] == "sdpa"), None)


def _passkey_cells(rows):
    """``{(method, stage, length): (correct, trials)}`` summed over depths."""
    acc: Dict[Tuple, List[int]] = {}
    for r in rows:
        if r["task"] == "passkey":
            c = acc.setdefault((r["method"], r["stage"], r["length"]), [0, 0])
            c[0] += int(r["correct"])
            c[1] += int(r["n"])
    return acc


def quality_markdown(rows: Sequence[Dict], settings: Optional[Dict] = None,
                     errors: Sequence[str] = ()) -> str:
    """The study's tables from its rows (see :func:`write_quality_report`)."""
    parts = ["# Quality study: dilated patterns vs dense sdpa"]
    if settings:
        parts.append(_settings_line(settings))
    ref = _reference(rows)
    methods = _ordered(r["method"] for r in rows)
    stages = [s for s in STAGES if any(r["stage"] == s for r in rows)]
    parts += _density_section(rows, methods)
    parts += _perplexity_section(rows, methods, stages, ref)
    parts += _passkey_section(rows, methods, stages)
    parts += _finetune_section(rows, ref)
    parts += _wall_section(rows)
    if errors:
        parts.append("\n## Failed\n\n" + "\n".join(f"- {e}" for e in errors))
    return "\n".join(parts) + "\n"


def _settings_line(s: Dict) -> str:
    return (
        f"\nModel `{s.get('model')}`, corpus `{s.get('corpus')}` (held-out stream "
        f"{s.get('heldout_tokens', '?')} tokens), {s.get('dtype')}; passkey "
        f"{len(s.get('depths', []))} depths x {s.get('trials')} trials, teacher-forced; "
        f"fine-tune {s.get('finetune_steps')} steps of {s.get('finetune_seq_len')} tokens, "
        f"lr {s.get('finetune_lr')}, warm-up {s.get('finetune_warmup')}, seed {s.get('seed')}"
        + (f", extra `{s['finetune_args']}`" if s.get("finetune_args") else "") + ".")


def _density_section(rows, methods) -> List[str]:
    parts: List[str] = []
    meta = {r["method"]: r for r in rows}
    dens = {(r["method"], r["length"]): r["density"] for r in rows
            if r["task"] in TASKS and r["density"] != ""}
    if dens:
        lengths = sorted({L for _, L in dens})
        parts.append("\n## Methods and density (allowed / dense causal pairs, all heads)\n")
        body = [[m, meta[m]["attn_implementation"], meta[m]["pattern"]]
                + [f"{100 * dens[(m, L)]:.2f} %" if (m, L) in dens else "" for L in lengths]
                for m in methods]
        parts.append(markdown_table(["method", "attention", "pattern"]
                                    + [str(L) for L in lengths], body))
    return parts


def _perplexity_section(rows, methods, stages, ref) -> List[str]:
    parts: List[str] = []
    ppl = {(r["method"], r["stage"], r["length"]): r["value"] for r in rows
           if r["task"] == "perplexity"}
    if ppl:
        lengths = sorted({k[2] for k in ppl})
        n_scored = next(r["n"] for r in rows if r["task"] == "perplexity")
        parts.append(f"\n## Perplexity by context length (held-out stream, windows of L every "
                     f"L/2, each of {n_scored} tokens scored once)\n")
        keys = [(m, s) for m in methods for s in stages
                if any((m, s, L) in ppl for L in lengths)]
        parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths],
                                    [[m, s] + [f"{ppl[(m, s, L)]:.3f}" if (m, s, L) in ppl
                                               else "" for L in lengths] for m, s in keys]))
        if ref is not None:
            parts.append(f"\nRatio to dense `{ref}` of the same stage (1.00 = as good as dense):\n")
            body = []
            for m, s in keys:
                row = [m, s]
                for L in lengths:
                    a, b = ppl.get((m, s, L)), ppl.get((ref, s, L))
                    row.append(f"{a / b:.3f}" if a is not None and b else "")
                body.append(row)
            parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths], body))
    return parts


def _passkey_section(rows, methods, stages) -> List[str]:
    parts: List[str] = []
    pk = _passkey_cells(rows)
    if pk:
        lengths = sorted({k[2] for k in pk})
        depths = sorted({r["depth"] for r in rows if r["task"] == "passkey"})
        parts.append(f"\n## Passkey retrieval (teacher-forced), correct / trials over depths "
                     f"{', '.join(f'{d:g}' for d in depths)}\n")
        keys = [(m, s) for m in methods for s in stages if any((m, s, L) in pk for L in lengths)]
        body = [[m, s] + [f"{pk[(m, s, L)][0]}/{pk[(m, s, L)][1]}" if (m, s, L) in pk else ""
                          for L in lengths] for m, s in keys]
        parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths], body))
        cell = {(r["method"], r["stage"], r["depth"], r["length"]): r for r in rows
                if r["task"] == "passkey"}
        parts.append("\nBy needle depth (correct / trials):\n")
        body = [[m, s, f"{d:g}"] + [f"{cell[(m, s, d, L)]['correct']}/{cell[(m, s, d, L)]['n']}"
                                    if (m, s, d, L) in cell else "" for L in lengths]
                for m, s in keys for d in depths]
        parts.append(markdown_table(["method", "stage", "depth"] + [str(L) for L in lengths],
                                    body))
    return parts


def _finetune_section(rows, ref) -> List[str]:
    parts: List[str] = []
    ft = [r for r in rows if r["task"] == "finetune"]
    if ft:
        ref_step = next((r["value"] for r in ft if r["method"] == ref), None)
        parts.append("\n## Fine-tune (hf_hilbert_attn.tools.finetune, one process; s/step and "
                     "tokens/s exclude the first step)\n")
        body = [[r["method"], r["n"], r["length"], r["value"], r["tokens_per_s"],
                 f"{r['value'] / ref_step:.3f}" if ref_step else "", r["final_loss"],
                 r["peak_mem_mb"] / 1024 if r["peak_mem_mb"] != "" else "", r["seconds"]]
                for r in ft]
        parts.append(markdown_table(["method", "steps", "seq len", "s/step", "tokens/s",
                                     f"step time / {ref or 'sdpa'}'s", "loss (last 10 steps)",
                                     "peak GiB", "wall s"], body))
    return parts


def _wall_section(rows) -> List[str]:
    parts: List[str] = []
    wall: "OrderedDict[Tuple[str, str], float]" = OrderedDict()
    seen = set()
    for r in rows:  # a passkey cell's seconds are repeated on each of its depth rows
        cell = (r["method"], r["stage"], r["task"], r["length"])
        if r["task"] in TASKS and cell not in seen:
            seen.add(cell)
            wall[cell[:2]] = wall.get(cell[:2], 0.0) + r["seconds"]
    if wall:
        parts.append("\n## Eval wall time (seconds; model loading excluded)\n")
        parts.append(markdown_table(["method", "stage", "seconds"],
                                    [[m, s, v] for (m, s), v in wall.items()]))
    return parts


def _colors(methods, ref):
    """Black for the dense control; tab10 without its grey (grey draws the stage legend)."""
    import matplotlib

    if len(methods) <= 10:
        palette = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
    else:
        palette = [c for i, c in enumerate(matplotlib.colormaps["tab20"].colors)
                   if i not in (14, 15)]
    out, i = {}, 0
    for m in methods:
        if m == ref:
            out[m] = "black"
        else:
            out[m] = palette[i % len(palette)]
            i += 1
    return out


def _length_label(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def plot_quality_perplexity(rows: Sequence[Dict], path) -> Optional[Path]:
    """Perplexity (left) and its ratio to dense sdpa (right) vs context length; one colour per
    method, base solid, finetuned dashed, the dense control black and thick; log2 x axis."""
    ppl = [r for r in rows if r["task"] == "perplexity"]
    if not ppl:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D

    ref = _reference(rows)
    methods = _ordered(r["method"] for r in ppl)
    colors = _colors(methods, ref)
    val = {(r["method"], r["stage"], r["length"]): r["value"] for r in ppl}
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=(13 if ref else 7.5, 5.0), squeeze=False)
    for stage, style in (("base", "-"), ("finetuned", "--")):
        for m in methods:
            pts = sorted((L, v) for (mm, s, L), v in val.items() if mm == m and s == stage)
            if not pts:
                continue
            kw = dict(color=colors[m], linestyle=style, marker="o",
                      linewidth=3.0 if m == ref else 1.5, markersize=4, zorder=3 if m == ref else 2)
            axes[0][0].plot([p[0] for p in pts], [p[1] for p in pts], **kw)
            if ref:
                rp = [(L, v / val[(ref, stage, L)]) for L, v in pts if (ref, stage, L) in val]
                if rp:
                    axes[0][1].plot([p[0] for p in rp], [p[1] for p in rp], **kw)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = axes[0][0]  # log y: a pattern at 4x dense must not flatten the dense curves
    ax.set_yscale("log")
    spread = max(val.values()) / max(min(val.values()), 1e-9)
    subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if spread > 4 else (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5,
                                                              3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("held-out perplexity")
    if ref:
        axes[0][1].axhline(1.0, color="grey", linewidth=0.8)
        axes[0][1].set_ylabel(f"perplexity / {ref}'s (same stage)")
        axes[0][1].set_title(f"ratio to dense {ref}")
    lengths = sorted({r["length"] for r in ppl})
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(L) for L in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colors[m], linewidth=3.0 if m == ref else 1.5, label=m)
               for m in methods]
    handles += [Line2D([], [], color="grey", linestyle="-", label="base"),
                Line2D([], [], color="grey", linestyle="--", label="finetuned")]
    axes[0][-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       fontsize=8, frameon=False)
    fig.suptitle("Perplexity vs context length: dilated patterns against dense attention")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_quality_passkey(rows: Sequence[Dict], path) -> Optional[Path]:
    """Passkey accuracy heat maps (method × length, mean over depths), one panel per stage."""
    pk = _passkey_cells(rows)
    if not pk:
        return None
    plt = _plt()
    methods = _ordered(r["method"] for r in rows if r["task"] == "passkey")
    stages = [s for s in STAGES if any(k[1] == s for k in pk)]
    lengths = sorted({k[2] for k in pk})
    fig, axes = plt.subplots(1, len(stages), squeeze=False,
                             figsize=(2.6 + 0.9 * len(lengths) * len(stages),
                                      1.4 + 0.38 * len(methods)))
    im = None
    for col, (ax, stage) in enumerate(zip(axes[0], stages)):
        grid = [[pk[(m, stage, L)][0] / pk[(m, stage, L)][1] if (m, stage, L) in pk
                 else float("nan") for L in lengths] for m in methods]
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for i, m in enumerate(methods):
            for j, L in enumerate(lengths):
                c = pk.get((m, stage, L))
                ax.text(j, i, f"{c[0]}/{c[1]}" if c else "-", ha="center", va="center",
                        fontsize=7)
        ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        ax.set_yticks(range(len(methods)), methods if col == 0 else [""] * len(methods))
        ax.set_xlabel("context length")
        ax.set_title(stage)
    fig.colorbar(im, ax=list(axes[0]), label="accuracy (all depths)")
    fig.suptitle("Passkey retrieval (teacher-forced)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_quality_report(out_dir, *, plots: bool = True, errors: Sequence[str] = (),
                         missing_ok: bool = False) -> Dict:
    """Redraw ``quality.md``, ``quality_ppl.png`` and ``quality_passkey.png`` from
    ``OUT/quality.csv`` (and ``OUT/study.json`` for the settings line).

    Returns:
        ``{"markdown": str, "files": {name: Path}}``.

    Raises:
        StudyError: ``OUT/quality.csv`` does not exist (unless ``missing_ok``: no rows yet).
    """
    out = Path(out_dir)
    csv_path = out / "quality.csv"
    if not csv_path.is_file() and not missing_ok:
        raise StudyError(f"no results to report: {csv_path} not found")
    rows = read_rows(csv_path) if csv_path.is_file() else []
    meta = out / "study.json"
    settings = json.loads(meta.read_text())["settings"] if meta.is_file() else None
    md = quality_markdown(rows, settings, errors)
    (out / "quality.md").write_text(md)
    files = {"csv": csv_path} if rows else {}
    files["markdown"] = out / "quality.md"
    if plots:
        p = plot_quality_perplexity(rows, out / "quality_ppl.png")
        if p:
            files["ppl_png"] = p
        p = plot_quality_passkey(rows, out / "quality_passkey.png")
        if p:
            files["passkey_png"] = p
    return {"markdown": md, "files": files}
