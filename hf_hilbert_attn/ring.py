"""Ring dilated attention over a sequence-parallel process group (placeholder: being written)."""

from __future__ import annotations

import contextlib
from typing import Optional

_ACTIVE_GROUP = []


@contextlib.contextmanager
def sequence_parallel(group):
    """Inside this context the registered ``hilbert_dilated`` attention runs as ring attention."""
    _ACTIVE_GROUP.append(group)
    try:
        yield group
    finally:
        _ACTIVE_GROUP.pop()


def get_sequence_parallel_group():
    """The active sequence-parallel group, or None (no context, or a group of size 1)."""
    if not _ACTIVE_GROUP or _ACTIVE_GROUP[-1] is None:
        return None
    import torch.distributed as dist

    g = _ACTIVE_GROUP[-1]
    return None if dist.get_world_size(g) == 1 else g


def ring_attention(q, k, v, pattern, *, group, q_positions, k_positions, causal=True, scale=None,
                   q_doc_ids=None, k_doc_ids=None, return_lse=False):
    raise NotImplementedError("ring_attention is being written")
