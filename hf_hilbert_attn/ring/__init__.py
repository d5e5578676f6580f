"""Ring dilated attention over a sequence-parallel process group (``docs/sequence_parallel.md``).

Each rank of the group holds a shard of the sequence: queries, keys and values of some tokens
together with their *true* positions (any layout: contiguous, zigzag, Hilbert, ...). The result
on every rank equals the rows of full-sequence :func:`~hf_hilbert_attn.dilated_attention` for
its queries.

1. **Agreement** (:mod:`.comm`). One small ``all_gather`` of shapes / pattern / dtype, so ranks
   that disagree raise a ``ValueError`` on *every* rank instead of hanging in a mismatched
   send/recv.
2. **Plan** (:mod:`.plan`, pure: no process group). Positions (and document ids) are
   all-gathered (int64, ``8·S`` bytes per rank). From them every rank computes, for each other
   rank, exactly which ``(kv head, key row)`` entries some query of that rank can attend
   (:func:`~.plan.key_need`), and splits each step into pieces over runs of consecutive
   positions. Both ends compute the same plan, so no sizes are exchanged; the last plan per
   group is reused while every rank's positions are unchanged (the next layers).
3. **Steps** (:mod:`.comm`). At step ``j`` rank ``r`` sends its needed K and V entries to
   ``r + j`` and receives from ``r - j``; step ``j + 1`` is posted before step ``j`` is
   computed. A step with nothing to send or receive costs nothing.
4. **Attention** (:mod:`.attention`). Each piece is a ``dilated_attention`` call with the
   block's true key positions; pieces of one query run merge through their log-sum-exps. The
   backward re-sends K/V, computes each piece's gradient from the merged ``(out, lse)`` and
   sends each received block's dK/dV back to its owner.
"""

from .attention import cached_plan, local_attention, ring_attention
from .comm import get_sequence_parallel_group, sequence_parallel
from .plan import RingPlan, key_need, plan_ring

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "ring_attention", "local_attention",
           "plan_ring", "RingPlan", "key_need", "cached_plan"]
