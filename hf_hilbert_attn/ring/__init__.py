"""Sequence parallelism over a process group (``docs/sequence_parallel.md``): the ring, and
head-sharded (Ulysses) attention (:mod:`.ulysses`).

Each rank holds a shard (q, k, v of some tokens with their *true* positions, any layout); every
rank gets the rows of full-sequence :func:`~hf_hilbert_attn.dilated_attention` for its queries.
In the ring, the ranks agree on shapes and pattern (:mod:`.comm`); each plans from all ranks' positions which
``(kv head, key row)`` entries each other rank needs and each step's pieces (:mod:`.plan`); at
step ``j`` rank ``r`` sends to ``r + j`` and receives from ``r - j``, overlapped with compute;
pieces merge by log-sum-exp, the backward sends dK/dV back to their owners (:mod:`.attention`).
"""

from .attention import cached_plan, local_attention, ring_attention
from .comm import get_sequence_parallel_group, get_sequence_parallel_mode, sequence_parallel
from .plan import RingPlan, key_need, plan_ring
from .ulysses import sequence_parallel_attention, ulysses_attention

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "get_sequence_parallel_mode",
           "sequence_parallel_attention", "ring_attention", "ulysses_attention",
           "local_attention", "plan_ring", "RingPlan", "key_need", "cached_plan"]
