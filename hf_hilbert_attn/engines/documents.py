"""The one document splitter: packed or padded self-attention as one call per document, for the
engines that take a single sequence at a time (the Triton kernels, the dense tiles)."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MAX_DOCUMENT_RUNS", "document_runs"]

# Beyond this many documents in one call, one call per document costs more than an engine that
# masks documents itself (the blockwise one).
MAX_DOCUMENT_RUNS = 4096


def document_runs(a, restart: bool = False) -> Optional[list]:
    """Packed or padded self-attention (``a``: ``inputs.check_inputs``) as ``[(row, lo, hi,
    p0)]``: storage ranges ``[lo, hi)`` each holding one whole document (doc id >= 0) at
    consecutive positions ``p0, p0 + 1, ...``; padding (doc id < 0) is left out: its queries
    attend nothing. None for any other layout (no document ids, queries and keys laid out
    differently, or a document split in two), for more than ``MAX_DOCUMENT_RUNS`` documents, or
    (``restart``) when a document does not start at position 0 (a continued one)."""
    if a.sq != a.sk or a.q_doc_ids is None:
        return None
    shape = (a.batch, a.sq)
    pos, doc = a.q_positions.expand(shape), a.q_doc_ids.expand(shape)
    if not (torch.equal(pos, a.k_positions.expand(shape))
            and torch.equal(doc, a.k_doc_ids.expand(shape))):
        return None
    pos, doc = pos.cpu(), doc.cpu()
    brk = (doc[:, 1:] != doc[:, :-1]) | (pos[:, 1:] != pos[:, :-1] + 1)
    ranges = []
    for b in range(a.batch):
        cuts = [0] + (torch.nonzero(brk[b]).flatten() + 1).tolist() + [a.sq]
        runs = [(lo, hi, int(doc[b, lo])) for lo, hi in zip(cuts[:-1], cuts[1:])]
        ids = [d for *_, d in runs if d >= 0]
        if len(set(ids)) < len(ids):  # a document split into several ranges: pairs would cross them
            return None
        ranges += [(b, lo, hi, int(pos[b, lo])) for lo, hi, d in runs if d >= 0]
    ok = len(ranges) <= MAX_DOCUMENT_RUNS
    return ranges if ok and not (restart and any(p0 for *_, p0 in ranges)) else None
