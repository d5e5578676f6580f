"""Hilbert-curve storage layouts (``docs/hilbert.md``): a layout of tokens, never a change of
the function.

The *generalised* Hilbert curve on any ``W x H`` rectangle: cut in halves (long) or three parts
(squarish), each the same construction rotated / reflected, joined end to start (the classic
curve on ``2^k x 2^k`` squares).

Guarantees (tested for every shape up to 40 x 40 and many larger ones): a bijection onto the
cells, starting at cell ``(0, 0)``, whose consecutive cells are grid neighbours for **every**
shape (where parity forbids ending on the start's side, ``_free_end`` ends elsewhere). Sub-curves
are cached by shape, so the recursion visits few shapes and the cells come from tensor ops.
"""

from __future__ import annotations

import operator
from functools import lru_cache
from typing import Optional, Tuple, Union

import torch

from .pattern import ORDERINGS, DilatedPattern

__all__ = ["hilbert_curve", "hilbert_permutation", "to_storage", "from_storage",
           "resolve_ordering", "storage_ordering"]

Device = Union[str, torch.device, None]


# ---------------------------------------------------------------------------------- the curve
def _even_half(n: int) -> int:
    """About half of ``n``, rounded to an even number when ``n > 2``: an even first part can
    always be traversed corner to corner along its long side with unit steps."""
    half = n // 2
    return half + 1 if half % 2 == 1 and n > 2 else half


def _frame(uv: torch.Tensor, origin=(0, 0), swap: bool = False, flip_u: int = 0,
           flip_v: int = 0) -> torch.Tensor:
    """Place a sub-curve ``uv`` ``[n, 2]`` into its parent's frame: ``swap`` exchanges the
    axes; ``flip_u`` / ``flip_v`` > 0 reflect that axis inside an extent of that many cells."""
    u, v = (uv.flip(1) if swap else uv).unbind(1)
    u, v = (flip_u - 1 - u if flip_u else u), (flip_v - 1 - v if flip_v else v)
    return torch.stack((u + origin[0], v + origin[1]), dim=1)


@lru_cache(maxsize=4096)
def _corner_to_corner(major: int, minor: int) -> torch.Tensor:
    """Generalised Hilbert curve on ``major x minor`` cells, as ``(u, v)`` int64 ``[n, 2]``.

    From ``(0, 0)`` to ``(major - 1, 0)``, both ends on the ``v = 0`` side like a Hilbert curve
    through a quadrant; unit steps only when (``major`` even or ``minor`` odd) and (``major >=
    2`` or ``minor == 1``), which every part inherits. ``_free_end`` takes the other shapes.
    """
    if minor == 1 or major == 1:
        # One row, or a single column (which cannot come back to its start; it ends at
        # (0, minor - 1)): its cells in order.
        return torch.cartesian_prod(torch.arange(major), torch.arange(minor))
    m2 = _even_half(major)
    if 2 * major > 3 * minor:
        # Long: two halves side by side along the major axis, both in the parent's orientation.
        return torch.cat((_corner_to_corner(m2, minor),
                          _frame(_corner_to_corner(major - m2, minor), origin=(m2, 0))))
    # Squarish: 1) the lower-left block [0, m2) x [0, n2), its long axis along v (up);
    # 2) the full-width top band [0, major) x [n2, minor), left to right;
    # 3) the lower-right block [m2, major) x [0, n2), coming back down to (major - 1, 0).
    n2 = _even_half(minor)
    return torch.cat((_frame(_corner_to_corner(n2, m2), swap=True),
                      _frame(_corner_to_corner(major, minor - n2), origin=(0, n2)),
                      _frame(_corner_to_corner(n2, major - m2), swap=True, flip_u=major - m2,
                             flip_v=n2, origin=(m2, 0))))


@lru_cache(maxsize=1024)
def _free_end(major: int, minor: int) -> torch.Tensor:
    """Curve on ``major x minor`` cells from ``(0, 0)``, ending anywhere; unit steps only.

    When ``major`` is odd and ``minor`` even, no unit-step path ends on the start's side
    (checkerboard parity): peel even halves off with ``_corner_to_corner`` while the rest is
    long, then traverse the last squarish block along its (even) minor side, ending at the far
    side.
    """
    if major % 2 == 0 or minor % 2 == 1:
        return _corner_to_corner(major, minor)
    if 2 * major > 3 * minor:
        m2 = _even_half(major)
        return torch.cat((_corner_to_corner(m2, minor),
                          _frame(_free_end(major - m2, minor), origin=(m2, 0))))
    return _frame(_corner_to_corner(minor, major), swap=True)


def _check_int(name: str, n, minimum: int) -> int:
    # operator.index accepts Python / numpy / 0-d tensor integers and rejects floats and strings.
    try:
        value = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {n!r}")
    return value


@lru_cache(maxsize=256)
def _hilbert_curve_cached(rows: int, cols: int) -> torch.Tensor:
    # The curve's long axis runs along the grid's longer side: (u, v) is (row, col) or (col, row).
    rc = _free_end(rows, cols) if rows >= cols else _free_end(cols, rows).flip(1)
    return (rc[:, 0] * cols + rc[:, 1]).contiguous()


def hilbert_curve(rows: int, cols: int) -> torch.Tensor:
    """The generalised Hilbert curve over a ``rows x cols`` grid.

    Args:
        rows, cols: grid size, any integers ``>= 1`` (not only powers of two).

    Returns:
        int64 CPU tensor ``[rows * cols]``: the flat cells ``row * cols + col`` in visiting order
        from cell 0, consecutive cells grid neighbours; cached and shared: do not modify.

    Raises:
        ValueError: if ``rows`` or ``cols`` is not an integer ``>= 1``.
    """
    return _hilbert_curve_cached(_check_int("rows", rows, 1), _check_int("cols", cols, 1))


# ---------------------------------------------------------------------------------- the layout
@lru_cache(maxsize=32)
def _permutation_cached(seq_len: int, segment: int, rate: int,
                        device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    # Offsets t of one segment in storage order: the grid cell of t is (t // rate, t % rate) (so
    # its flat index is t itself); cells >= segment of a ragged last row are skipped.
    rows = -(-segment // rate)
    curve = hilbert_curve(rows, rate)
    order = curve[curve < segment] if rows * rate != segment else curve  # int64 [segment]
    # Every segment the same curve; in the last, partial one positions >= seq_len are skipped.
    perm = (torch.arange(-(-seq_len // segment))[:, None] * segment + order[None, :]).flatten()
    perm = perm[perm < seq_len]
    return perm.to(device), torch.argsort(perm).to(device)  # (the inverse permutation)


def hilbert_permutation(seq_len: int, pattern: DilatedPattern,
                        device: Device = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The Hilbert storage layout of ``seq_len`` tokens for ``pattern`` (``docs/hilbert.md``).

    Within each segment of the longest config (``w = pattern.max_segment``; the last may be
    partial), offsets ``t`` form a grid of ``ceil(w / R)`` rows by ``R = pattern.max_rate``
    columns (cell ``(t // R, t % R)``: a column per dilation class), visited in Hilbert-curve
    order; tokens never leave their segment (``R == 1``: the identity).

    ``seq_len`` tokens (an int ``>= 0``, else ``ValueError``) of ``pattern`` (a
    :class:`DilatedPattern`, else ``TypeError``; its longest segment and largest rate matter), on
    ``device`` (default CPU). Returns ``(perm, inv)``, int64 ``[seq_len]`` exact inverses:
    ``perm[i]`` the position of the token stored at ``i``, ``inv[p]`` the storage index of ``p``.
    Cached per ``(seq_len, max_segment, max_rate, device)`` and shared: do not modify.
    """
    if not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
    seq_len = _check_int("seq_len", seq_len, 0)
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:  # (cached per device: the current one)
        device = torch.device("cuda", torch.cuda.current_device())
    return _permutation_cached(seq_len, pattern.max_segment, pattern.max_rate, device)


def to_storage(x: torch.Tensor, perm: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Natural to storage order along ``dim`` (default: ``S`` of ``[B, H, S, D]``):
    ``out.select(dim, i) == x.select(dim, perm[i])``. Differentiable."""
    return x.index_select(dim, perm.to(x.device))


def from_storage(x: torch.Tensor, inv: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Undo :func:`to_storage`: ``out.select(dim, p) == x.select(dim, inv[p])``."""
    return x.index_select(dim, inv.to(x.device))


# ---------------------------------------------------------------------------------- orderings
def resolve_ordering(pattern: DilatedPattern, seq_len: int, head_dim: Optional[int] = None,
                     device: Device = None) -> str:
    """What ``ordering="auto"`` means for a shape: ``"natural"`` or ``"hilbert"``.

    Measured, not guessed (``docs/decisions.md``): the Triton kernels tile each dilation class
    with strided loads, so natural order already gets dense tiles and Hilbert order only adds
    position-table reads (H200, bf16, D=128, 16K and 64K: Hilbert fwd+bwd at 0.75-0.88x the
    speed of natural, never faster). So ``"natural"`` for every shape.
    """
    return "natural"


def storage_ordering(pattern: DilatedPattern, seq_len: int, head_dim: Optional[int] = None,
                     device: Device = None, ordering: Optional[str] = None) -> str:
    """The layout ``ordering`` (default ``pattern.ordering``) gives ``seq_len`` tokens:
    ``"natural"`` or ``"hilbert"`` (``"auto"`` through :func:`resolve_ordering`; a pattern of
    rate 1 only has nothing to reorder)."""
    ordering = pattern.ordering if ordering is None else ordering
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
    if ordering == "auto":
        ordering = resolve_ordering(pattern, seq_len, head_dim, device)
    return "natural" if pattern.max_rate == 1 else ordering

