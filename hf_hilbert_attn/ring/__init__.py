"""Ring dilated attention over a sequence-parallel process group (``docs/sequence_parallel.md``).

Each rank holds a shard (q, k, v of some tokens with their *true* positions, any layout); every
rank gets the rows of full-sequence :func:`~hf_hilbert_attn.dilated_attention` for its queries.
The ranks agree on shapes and pattern (:mod:`.comm`); each plans from all ranks' positions which
``(kv head, key row)`` entries each other rank needs and each step's pieces (:mod:`.plan`); at
step ``j`` rank ``r`` sends to ``r + j`` and receives from ``r - j``, overlapped with compute;
pieces merge by log-sum-exp, the backward sends dK/dV back to their owners (:mod:`.attention`).
"""

from .attention import cached_plan, local_attention, ring_attention
from .comm import get_sequence_parallel_group, sequence_parallel
from .plan import RingPlan, key_need, plan_ring

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "ring_attention", "local_attention",
           "plan_ring", "RingPlan", "key_need", "cached_plan"]
