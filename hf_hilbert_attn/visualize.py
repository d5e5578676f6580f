"""Pictures and numbers of a pattern's mask: ASCII for small lengths, PNG, sparsity and FLOPs.

The mask comes from :meth:`DilatedPattern.build_mask` / :meth:`DilatedPattern.allowed` and the
counts from :meth:`DilatedPattern.count_pairs`; nothing here restates the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence

import torch

from .pattern import DilatedPattern

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
    pos = torch.arange(length)
    m = pattern.build_mask(head + 1, pos, pos, causal=causal)[0, head]  # [S, S]
    width = len(str(length - 1))
    lines = []
    for p in range(length):
        row = "".join(
            "#" if m[p, s] else (" " if causal and s > p else ".") for s in range(length))
        lines.append(f"{p:>{width}} {row}  {int(m[p].sum())}")
    return "\n".join(lines)


def pattern_summary(pattern: DilatedPattern, length: int, num_heads: int = 1, *,
                    causal: bool = True) -> Dict:
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
    pairs = pattern.count_pairs(length, num_heads, causal=causal)
    dense = length * (length + 1) // 2 if causal else length * length
    last = pattern.count_pairs(length, 1, causal=causal, q_len=1)[0]
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
    # only the key tiles within that reach of the query tile are evaluated.
    reach = -(-pattern.max_segment // block)
    for i in range(n):
        q = i * block + offsets
        q = q[q < length]
        lo, hi = max(0, i - reach), min(n, i + reach + 1)
        k = keys[lo * block:min(length, hi * block)]
        m = pattern.allowed(head, q[:, None], k[None, :])
        if causal:
            m = m & (k[None, :] <= q[:, None])
        m = torch.nn.functional.pad(m.float(), (0, (hi - lo) * block - k.numel()))
        out[i, lo:hi] = m.view(len(q), hi - lo, block).sum(dim=(0, 2)) / (len(q) * block)
    return out


def save_mask_png(pattern: DilatedPattern, length: int, path, *, heads: Sequence[int] = (0,),
                  causal: bool = True, max_pixels: int = 512) -> Path:
    """Draw the mask of each head in ``heads`` into one PNG (matplotlib Agg).

    Up to ``max_pixels`` tokens each pair is one pixel; beyond, each pixel is the fraction of
    allowed pairs in its tile (a density picture, estimated from a few query rows per tile), so
    long lengths can be drawn (128K tokens: a few seconds).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(heads)
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 4.4), squeeze=False)
    for ax, h in zip(axes[0], heads):
        img = _block_density(pattern, length, h, causal, max_pixels)
        ax.imshow(img.numpy(), cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest",
                  extent=(0, length, length, 0))
        ax.set_title(f"head {h}" + ("" if length <= max_pixels else " (tile density)"),
                     fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.suptitle(f"{pattern}, length {length}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
