"""The one document splitter: packed or padded self-attention as one call per document, for the
engines that take a single sequence at a time (the Triton kernels, the dense tiles)."""

from __future__ import annotations

from typing import Optional

from ..inputs import document_ranges

__all__ = ["MAX_DOCUMENT_RUNS", "document_runs"]

# Beyond this many documents in one call, one call per document costs more than an engine that
# masks documents itself (the blockwise one).
MAX_DOCUMENT_RUNS = 4096


def document_runs(a, restart: bool = False) -> Optional[list]:
    """``[(row, lo, hi, p0)]``: storage ranges ``[lo, hi)`` each holding one whole document (doc
    id >= 0) at consecutive positions from ``p0`` (``inputs.document_ranges``; padding left out:
    its queries attend nothing). None for any other layout, for more than
    ``MAX_DOCUMENT_RUNS`` documents, or (``restart``) when a document does not start at position
    0 (a continued one)."""
    ranges = document_ranges(a)  # (None without document ids)
    ok = ranges is not None and len(ranges) <= MAX_DOCUMENT_RUNS
    return ranges if ok and not (restart and any(p0 for *_, p0 in ranges)) else None
