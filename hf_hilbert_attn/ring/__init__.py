"""Ring dilated attention over a sequence-parallel process group (``docs/sequence_parallel.md``).

Each rank holds a shard of the sequence (q, k, v of some tokens with their *true* positions, in
any layout); the result on every rank equals the rows of full-sequence
:func:`~hf_hilbert_attn.dilated_attention` for its queries. Steps: the ranks agree on shapes and
pattern (:mod:`.comm`); every rank plans, from all ranks' positions, which ``(kv head, key
row)`` entries each other rank needs and the pieces of each step (:mod:`.plan`, pure, reused
while positions are unchanged); at step ``j`` rank ``r`` sends them to ``r + j`` and receives
from ``r - j``, overlapped with compute; the pieces merge by log-sum-exp and the backward sends
dK/dV back to their owners (:mod:`.attention`).
"""

from .attention import cached_plan, local_attention, ring_attention
from .comm import get_sequence_parallel_group, sequence_parallel
from .plan import RingPlan, key_need, plan_ring

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "ring_attention", "local_attention",
           "plan_ring", "RingPlan", "key_need", "cached_plan"]
