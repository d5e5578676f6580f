"""Pictures and numbers of a pattern's mask: ASCII for small lengths, PNG, sparsity and FLOPs.

The mask comes from :meth:`DilatedPattern.build_mask` / :meth:`DilatedPattern.allowed` and the
counts from :meth:`DilatedPattern.count_pairs`; nothing here restates the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Sequence

if TYPE_CHECKING:  # torch loads with the first picture: the CLI's parser reads ASCII_MAX_LENGTH
    import torch

    from hf_hilbert_attn.pattern import DilatedPattern

__all__ = ["ascii_mask", "pattern_summary", "save_mask_png", "ASCII_MAX_LENGTH"]

ASCII_MAX_LENGTH = 128


def ascii_mask(pattern: DilatedPattern, length: int, *, head: int = 0, causal: bool = True) -> str:
    """The mask of one head as text: row = query position, column = key position.

    ``#`` allowed, ``.`` not allowed by the pattern, blank = in the future (causal).
    Rows carry the query position and the number of keys it attends.

    Raises:
        ValueError: ``length`` not in ``[1, ASCII_MAX_LENGTH]`` or ``head < 0``.
    """
    if not 1 <= length <= ASCII_MAX_LENGTH:
        raise ValueError(f"ASCII pictures need 1 <= length <= {ASCII_MAX_LENGTH}, got {length}")
    if head < 0:
        raise ValueError(f"head must be >= 0, got {head}")
    import torch

    pos = torch.arange(length)
    # dense key/value heads: shown as for one key/value head per query head (MHA)
    m = pattern.build_mask(head + 1, pos, pos, causal=causal, num_kv_heads=head + 1)[0, head]
    width = len(str(length - 1))
    lines = []
    for p in range(length):
        row = "".join(
            "#" if m[p, s] else (" " if causal and s > p else ".") for s in range(length))
        lines.append(f"{p:>{width}} {row}  {int(m[p].sum())}")
    return "\n".join(lines)


def pattern_summary(pattern: DilatedPattern, length: int, num_heads: int = 1, *,
                    causal: bool = True, num_kv_heads: Optional[int] = None) -> Dict:
    """Sparsity and cost of ``pattern`` at ``length`` tokens.

    Returns:
        A dict: ``pairs_per_head`` (allowed pairs per head), ``dense_pairs`` (the causal or full
        count per head), ``density`` (allowed / dense, mean over heads), ``sparsity``
        (1 - density), ``keys_per_query_mean``, ``keys_per_query_last`` (keys the last query
        attends, head 0), ``flops_ratio`` (useful FLOPs vs dense attention at the same length).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if num_heads < 1:
        raise ValueError(f"heads must be >= 1, got {num_heads}")
    kv = num_heads if num_kv_heads is None else num_kv_heads  # dense heads: MHA unless told
    pairs = pattern.count_pairs(length, num_heads, causal=causal, num_kv_heads=kv)
    dense = length * (length + 1) // 2 if causal else length * length
    last = pattern.count_pairs(length, num_heads, causal=causal, q_len=1, num_kv_heads=kv)[0]
    density = sum(pairs) / (dense * num_heads)
    return dict(
        length=length, num_heads=num_heads, causal=causal, pairs_per_head=pairs,
        dense_pairs=dense, density=density, sparsity=1.0 - density,
        keys_per_query_mean=sum(pairs) / (num_heads * length),
        keys_per_query_last=last, flops_ratio=density,
    )


def _block_density(pattern: DilatedPattern, length: int, head: int, causal: bool,
                   pixels: int, rows_per_tile: int = 8) -> torch.Tensor:
    """Fraction of allowed pairs per ``block × block`` tile, ``[P, P]``.

    Exact while a tile has at most ``rows_per_tile`` query rows; beyond, each tile row is
    estimated from ``rows_per_tile`` evenly spread queries (offsets chosen so they fall into
    different dilation classes), so the cost is ``O(P · rows_per_tile · length)``.
    """
    import torch

    block = -(-length // pixels)
    n = -(-length // block)
    out = torch.zeros(n, n)
    keys = torch.arange(length)
    if block <= rows_per_tile:
        offsets = torch.arange(block)
    else:  # spread over the tile, with an odd step so that residues mod r vary
        step = max(1, block // rows_per_tile) | 1
        offsets = (torch.arange(rows_per_tile) * step) % block
    # An allowed pair shares a segment of some config, so |p - s| < the longest segment:
    # only the key tiles within that reach of the query tile are evaluated (a dense head: all).
    dense = head in pattern.dense_kv_heads  # shown as MHA: query head h reads key/value head h
    reach = n if dense else -(-pattern.max_segment // block)
    for i in range(n):
        q = i * block + offsets
        q = q[q < length]
        lo, hi = max(0, i - reach), min(n, i + reach + 1)
        k = keys[lo * block:min(length, hi * block)]
        m = pattern.allowed(head, q[:, None], k[None, :], num_heads=head + 1,
                            num_kv_heads=head + 1)
        if causal:
            m = m & (k[None, :] <= q[:, None])
        m = torch.nn.functional.pad(m.float(), (0, (hi - lo) * block - k.numel()))
        out[i, lo:hi] = m.view(len(q), hi - lo, block).sum(dim=(0, 2)) / (len(q) * block)
    return out


def save_mask_png(pattern: DilatedPattern, length: int, path, *, heads: Sequence[int] = (0,),
                  causal: bool = True, max_pixels: int = 512) -> Path:
    """Draw the mask of each head in ``heads`` into one PNG (matplotlib Agg).

    Up to ``max_pixels`` tokens each pair is one pixel (black allowed, light grey masked by the
    pattern, white the causal future; a legend says so); beyond, each pixel is the fraction of
    allowed pairs in its tile (a density picture, estimated from a few query rows per tile, on
    a logarithmic colour bar so sparse far-away configs stay visible), so long lengths can be
    drawn (128K tokens: a few seconds). Axis ticks are token positions (``16K``, ``32K``, …).
    A path without a suffix gets ``.png``.

    Returns:
        The path of the file written.
    """
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    heads = list(heads)
    exact = length <= max_pixels
    fig, axes = plt.subplots(1, len(heads), figsize=(3.6 * len(heads) + 1.4, 4.4),
                             squeeze=False, layout="constrained")
    ticks = FuncFormatter(lambda v, _: _token_label(v))
    step = 1 << max(0, (max(1, length // 4)).bit_length() - 1)  # a power of two, 4-7 ticks
    im = None
    for ax, h in zip(axes[0], heads):
        img = _block_density(pattern, length, h, causal, max_pixels)
        if exact:  # 0 masked, 1 allowed, 2 future (above the diagonal)
            idx = torch.where(img > 0, 1, 0)
            if causal:
                idx = torch.where(torch.ones_like(idx, dtype=torch.bool).triu(1), 2, idx)
            ax.imshow(idx.numpy(), cmap=ListedColormap(["#d9d9d9", "black", "white"]), vmin=0,
                      vmax=2, interpolation="nearest", extent=(0, length, length, 0))
        else:  # tiles without an allowed pair are white (0 is "bad" on a log scale)
            low = float(img[img > 0].min()) if bool((img > 0).any()) else 1e-6
            im = ax.imshow(img.numpy(), cmap=plt.get_cmap("magma_r").with_extremes(bad="white"),
                           norm=LogNorm(vmin=min(low, 0.1), vmax=1.0), interpolation="nearest",
                           extent=(0, length, length, 0))
        ax.set_title(f"head {h}" + ("" if exact else " (fraction of pairs allowed per tile)"),
                     fontsize=9)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MultipleLocator(step))
            axis.set_major_formatter(ticks)
        ax.tick_params(labelsize=8)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    if exact:
        legend = [Patch(facecolor="black", label="allowed"),
                  Patch(facecolor="#d9d9d9", edgecolor="#999999", label="masked by the pattern")]
        if causal:
            legend.append(Patch(facecolor="white", edgecolor="#999999", label="future (causal)"))
        fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), fontsize=8)
    elif im is not None:
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8,
                     label="allowed pairs / pairs in the tile (log scale)")
    fig.suptitle(f"{pattern}\nlength {_token_label(length)} tokens", fontsize=9)
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _token_label(v: float) -> str:
    """A tick label: 512, 16K, 1.5K, 1M."""
    v = int(round(v))
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if v >= div:
            x = v / div
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.1f}{unit}"
    return str(v)
