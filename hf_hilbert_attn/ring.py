"""Ring dilated attention over a sequence-parallel process group (DESIGN §4, "Ring advice").

Each rank of the group holds a shard of the sequence: queries, keys and values of some tokens
together with their *true* positions (any layout: contiguous, zigzag, Hilbert, ...). The result
on every rank equals the rows of full-sequence :func:`~hf_hilbert_attn.dilated_attention` for
its queries.

How it works
------------
1. **Agreement.** One small ``all_gather`` of shapes / pattern / dtype, so ranks that disagree
   raise a ``ValueError`` on *every* rank instead of hanging in a mismatched send/recv.
2. **Plan.** Positions (and document ids) are all-gathered (int64, ``8·S`` bytes per rank —
   small next to K/V). From them every rank computes, for each other rank, exactly which
   ``(kv head, key row)`` entries some query of that rank can attend under the pattern
   (:func:`_key_need`: the rule of ``pattern.py`` per (segment, class) bucket, per class and
   window for sliding windows, plus the sink tokens; documents are ignored, which makes it a
   superset). Both ends compute the same plan, so no sizes are exchanged; the last plan is
   reused while every rank's positions are unchanged (the next layers of the same forward). A
   config whose segments stay inside a shard contributes nothing remote; a dilated config only
   its classes, and per kv head only the classes of that head's query heads (``per_head``
   mode); a sliding config only the keys less than ``w_i`` positions from a query of their
   class (contiguous shards: the end of the previous shard); sink keys (positions
   ``< sink_tokens``) go, to every kv head, to each rank with a query at or after them.
3. **Steps.** At step ``j`` rank ``r`` sends its needed K and V entries (separate buffers) to
   ``r + j`` and receives from ``r - j`` (``batch_isend_irecv``); step ``j + 1`` is posted
   before step ``j`` is computed, so communication overlaps compute. A step with nothing to
   send or receive costs nothing. Unsent entries of a received block are zero and are never
   attended (the plan is a superset of the allowed pairs), so each block is an ordinary call of
   ``dilated_attention`` with the block's true key positions.
4. **Pieces.** Each step is computed as a few ``dilated_attention`` calls ("pieces", planned
   once with the send plan): the shard's queries are split into runs of consecutive positions,
   and so are the local keys, so a contiguous or zigzag shard runs the kernels without position
   tables and skips run pairs no segment, window or sink joins; a received block is one call
   per query run its key range can reach. Each piece's kernel position plan is made on its
   first call and kept with the cached ring plan, so later layers and the backward read no
   positions (no host syncs per piece).
5. **Merge.** Per-piece ``(out_b, lse_b)`` are merged in float32 where a query run gets several
   pieces (``lse = logaddexp(lse, lse_b)``, ``out = Σ_b exp(lse_b - lse) · out_b``); a run with
   one piece takes it as it is. Each key lives on exactly one rank, so the union rule of
   DESIGN §1 (a key counts once) holds across steps.
6. **Backward** (custom autograd Function) re-sends K/V with the same plan and computes each
   piece's gradient from the *merged* ``(out, lse)``
   (:func:`~hf_hilbert_attn.ops.dilated_attention_backward`: FlashAttention's
   ``dS = P ∘ (dP - delta)`` with the final probabilities, no forward recomputation on the
   Triton path), then sends each received block's dK/dV (float32) back to the rank owning
   those keys.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import zlib
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .ops import (attention_forward_into, autocast_dtype, cast_for_autocast, dilated_attention,
                  position_plan, with_documents)
from .pattern import DilatedPattern

logger = logging.getLogger(__name__)

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "ring_attention", "local_attention",
           "plan_ring"]

_ACTIVE_GROUP = []


@contextlib.contextmanager
def sequence_parallel(group):
    """Inside this context the registered ``hilbert_dilated`` attention runs as ring attention.

    Args:
        group: a ``torch.distributed`` process group whose ranks each hold one shard of the
            sequence (see :func:`hf_hilbert_attn.sharding.shard_batch`), or None (no ring).

    Example::

        with hf_hilbert_attn.sequence_parallel(group):
            loss = model(**shard_batch(batch, group)).loss
    """
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


# ---------------------------------------------------------------------------------- the plan
def _key_need(pattern: DilatedPattern, hq: int, hkv: int, causal: bool,
              q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Which ``(kv head, key row)`` some query can attend: bool ``[Hkv, Sk]``.

    ``q_pos`` ``[Bq, Sq]``, ``k_pos`` ``[Bk, Sk]`` (int64, >= 0). A key row is needed for a
    batch entry if, for some config, some query of that entry is in the key's (segment, class)
    bucket (sliding windows: has the key's class and lies less than ``w`` positions from it)
    and is not before it (causal), and — per_head — some query head of the kv head uses that
    class; or if the key is a sink (position ``< sink_tokens``) and some query is not before it.
    Documents are ignored: the result is a superset of the allowed pairs, which is all a send
    plan needs. O((Sq + Sk) · log · configs + S/w·r), no S².
    """
    dev = k_pos.device
    b = max(q_pos.shape[0], k_pos.shape[0])
    qp = q_pos.expand(b, -1)
    kp = k_pos.expand(b, -1)
    sk = kp.shape[1]
    need = torch.zeros(hkv, sk, dtype=torch.bool, device=dev)
    if qp.numel() == 0 or sk == 0:
        return need
    hi = int(torch.maximum(qp.max(), kp.max())) + 1
    per_head = pattern.query_dilation == "per_head"
    heads_of_kv = torch.arange(hq, device=dev).view(hkv, hq // hkv)  # [Hkv, G] query heads
    for w, r in pattern.configs:
        if pattern.sliding:
            kcls = torch.remainder(kp, r)
            ok = _window_reach(qp, kp, w, r, causal, hi)  # [B, Sk]
        else:
            nb = (hi // w + 1) * r  # (segment, class) buckets per batch entry
            off = (torch.arange(b, device=dev) * nb).unsqueeze(1)
            qcls = torch.remainder(qp, w) % r
            kcls = torch.remainder(kp, w) % r
            qb = (qp // w * r + qcls + off).flatten()
            kb = kp // w * r + kcls + off  # [B, Sk]
            if causal:
                # latest query position per bucket; a key is reachable iff it is not after it
                latest = torch.full((b * nb,), -1, dtype=torch.int64, device=dev)
                latest.scatter_reduce_(0, qb, qp.flatten(), reduce="amax")
                ok = latest[kb] >= kp  # [B, Sk]
            else:
                hit = torch.zeros(b * nb, dtype=torch.bool, device=dev)
                hit[qb] = True
                ok = hit[kb]
        if per_head and r > 1:
            # kv head g serves class c iff one of its query heads h has h % r == c
            serves = torch.zeros(hkv, r, dtype=torch.bool, device=dev)
            serves.scatter_(1, heads_of_kv % r, True)
            need |= (serves[:, kcls] & ok.unsqueeze(0)).any(1)  # [Hkv, B, Sk] -> [Hkv, Sk]
        else:
            need |= ok.any(0).unsqueeze(0)
    if pattern.sink_tokens:  # every head, every query not before the sink
        ok = kp < pattern.sink_tokens
        if causal:
            ok &= kp <= qp.amax(1, keepdim=True)
        need |= ok.any(0).unsqueeze(0)
    return need


def _window_reach(qp: torch.Tensor, kp: torch.Tensor, w: int, r: int, causal: bool,
                  hi: int) -> torch.Tensor:
    """bool ``[B, Sk]``: some query of the key's batch entry and class ``p ≡ s (mod r)`` lies
    in ``[s, s + w - 1]`` (non-causal ``[s - w + 1, s + w - 1]``). Positions ``< hi``.

    Queries sorted by (batch entry, class, position) as one int64 key; per key, one search for
    the first query at or after the window's start, which is in the window iff it is not past
    its end.
    """
    b = qp.shape[0]
    dev = qp.device
    lo_off = 0 if causal else w - 1
    span = hi + 2 * w  # s - lo_off + w >= 1 and s + (w - 1) + w < span: buckets never touch
    if b * r * span >= 2**62:  # positions too large for one key: one search per bucket
        out = torch.zeros(kp.shape, dtype=torch.bool, device=dev)
        for e in range(b):
            qc, kc = torch.remainder(qp[e], r), torch.remainder(kp[e], r)
            for c in torch.unique(kc).tolist():
                qs = torch.sort(qp[e][qc == c]).values
                sel = (kc == c).nonzero().flatten()
                if qs.numel() == 0:
                    continue
                s = kp[e].index_select(0, sel)
                idx = torch.searchsorted(qs, s - lo_off)
                first = qs[idx.clamp(max=qs.numel() - 1)]
                out[e, sel] = (idx < qs.numel()) & (first <= s + (w - 1))
        return out
    entry = torch.arange(b, device=dev).unsqueeze(1) * r
    q_key = torch.sort(((entry + torch.remainder(qp, r)) * span + qp + w).flatten()).values
    k_base = (entry + torch.remainder(kp, r)) * span + kp + w  # [B, Sk]
    idx = torch.searchsorted(q_key, k_base - lo_off)
    first = q_key[idx.clamp(max=q_key.numel() - 1)]
    return (idx < q_key.numel()) & (first <= k_base + (w - 1))


@dataclass
class _Step:
    """Ring step ``j`` seen from one rank: what it sends to ``dst``, receives from ``src``."""

    j: int
    dst: int  # group rank we send our keys to
    src: int  # group rank whose keys we receive
    send_head: torch.Tensor  # [Ns] kv head of each sent entry
    send_row: torch.Tensor  # [Ns] local key row of each sent entry
    send_dense: bool  # the entries are all heads x send_rows (a plain k[:, :, rows] slice)
    send_rows: torch.Tensor  # [Us] distinct rows sent
    recv_head: torch.Tensor  # [Nr]
    recv_slot: torch.Tensor  # [Nr] index into the received block's rows
    recv_dense: bool
    recv_rows: torch.Tensor  # [Ur] src's key rows that make up the received block
    recv_kpos: torch.Tensor  # [Bp, Ur] true positions of the received block
    recv_kdoc: Optional[torch.Tensor]  # [Bd, Ur] or None

    @property
    def n_send(self) -> int:
        return int(self.send_head.numel())

    @property
    def n_recv(self) -> int:
        return int(self.recv_head.numel())


@dataclass
class RingPlan:
    """The send/receive plan of one rank (see :func:`plan_ring`)."""

    rank: int
    world: int
    hkv: int
    steps: List[_Step] = field(default_factory=list)  # steps 1..world-1

    def entries_sent(self) -> int:
        """(kv head, row) entries this rank sends per tensor (K or V) in one forward."""
        return sum(s.n_send for s in self.steps)


def _entries(need: torch.Tensor):
    """(heads, rows, distinct rows, dense?) of a need mask ``[Hkv, S]``."""
    rows = need.any(0).nonzero().flatten()
    head, row = need.nonzero(as_tuple=True)
    dense = head.numel() == need.shape[0] * rows.numel()
    return head, row, rows, dense


def plan_ring(pattern: DilatedPattern, hq: int, hkv: int, causal: bool, rank: int,
              q_positions: List[torch.Tensor], k_positions: List[torch.Tensor],
              k_doc_ids: Optional[List[torch.Tensor]] = None) -> RingPlan:
    """The ring plan of ``rank`` given every rank's positions.

    Args:
        pattern, hq, hkv, causal: the attention being computed.
        rank: the group rank to plan for.
        q_positions, k_positions: per group rank, ``[Bp, S]`` int64 true positions.
        k_doc_ids: per group rank ``[Bd, S]`` or None.

    Returns:
        A :class:`RingPlan`. A pure function of its arguments, so sender and receiver compute
        matching halves of each exchange without telling each other sizes.
    """
    world = len(k_positions)
    plan = RingPlan(rank, world, hkv)
    for j in range(1, world):
        dst, src = (rank + j) % world, (rank - j) % world
        sh, sr, srows, sdense = _entries(
            _key_need(pattern, hq, hkv, causal, q_positions[dst], k_positions[rank]))
        need_in = _key_need(pattern, hq, hkv, causal, q_positions[rank], k_positions[src])
        rh, rr, rrows, rdense = _entries(need_in)
        slot_of_row = torch.cumsum(need_in.any(0), 0) - 1
        plan.steps.append(_Step(
            j, dst, src, sh, sr, sdense, srows, rh, slot_of_row[rr], rdense, rrows,
            k_positions[src].index_select(1, rrows),
            None if k_doc_ids is None else k_doc_ids[src].index_select(1, rrows)))
    return plan


# ---------------------------------------------------------------------------------- comms
def _post(sends, recvs, group):
    """Post point-to-point ops ``(tensor, group_peer, tag)``; returns the Work handles."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group, tag)
           for t, p, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group, tag)
            for t, p, tag in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def _gather_entries(x: torch.Tensor, step: _Step) -> torch.Tensor:
    """Entries of local ``x`` ``[B, H, S, D]`` to send: flat ``[B, Ns, D]`` contiguous."""
    if step.send_dense:
        return x.index_select(2, step.send_rows).flatten(1, 2).contiguous()
    return x[:, step.send_head, step.send_row].contiguous()


def _scatter_block(flat: torch.Tensor, step: _Step, hkv: int) -> torch.Tensor:
    """Received flat entries ``[B, Nr, D]`` -> block ``[B, Hkv, Ur, D]`` (zeros where unsent)."""
    b, _, d = flat.shape
    ur = step.recv_rows.numel()
    if step.recv_dense:
        return flat.view(b, hkv, ur, d)
    block = flat.new_zeros(b, hkv, ur, d)
    block[:, step.recv_head, step.recv_slot] = flat
    return block


def _entries_of_block(block: torch.Tensor, step: _Step) -> torch.Tensor:
    """Inverse of :func:`_scatter_block` (for sending a block's gradient back)."""
    if step.recv_dense:
        return block.flatten(1, 2).contiguous()
    return block[:, step.recv_head, step.recv_slot].contiguous()


class _KVExchange:
    """Double-buffered K/V exchange: ``post(j)`` starts step ``j``, ``block(j)`` waits for it."""

    def __init__(self, k, v, plan: RingPlan, group):
        self.k, self.v, self.plan, self.group = k, v, plan, group
        self.pending = {}

    def post(self, j: int):
        if j >= self.plan.world or j in self.pending:
            return
        st = self.plan.steps[j - 1]
        b, _, _, d = self.k.shape
        sends, recvs, keep = [], [], []
        if st.n_send:
            ks, vs = _gather_entries(self.k, st), _gather_entries(self.v, st)
            sends = [(ks, st.dst, 4 * j), (vs, st.dst, 4 * j + 1)]
            keep = [ks, vs]
        kr = vr = None
        if st.n_recv:
            kr = self.k.new_empty(b, st.n_recv, d)
            vr = self.v.new_empty(b, st.n_recv, self.v.shape[-1])
            recvs = [(kr, st.src, 4 * j), (vr, st.src, 4 * j + 1)]
        self.pending[j] = (_post(sends, recvs, self.group), kr, vr, keep)

    def block(self, j: int):
        """``(k_blk, v_blk)`` of step ``j`` (``[B, Hkv, Ur, D]``), or None if nothing comes."""
        works, kr, vr, _ = self.pending.pop(j)
        for w in works:
            w.wait()
        if kr is None:
            return None
        st = self.plan.steps[j - 1]
        return _scatter_block(kr, st, self.plan.hkv), _scatter_block(vr, st, self.plan.hkv)


# ---------------------------------------------------------------------------------- checks
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_META_FIELDS = ("batch size", "query heads", "key/value heads", "query shard length",
                "key shard length", "head_dim", "value head_dim", "causal", "pattern (crc32)",
                "scale (float64 bits)", "dtype", "q_positions batch", "k_positions batch",
                "document ids given", "document ids batch", "device type (1 = cuda)")


def _pattern_crc(pattern: DilatedPattern) -> int:
    """crc32 of the fields that define the function (the storage ordering does not)."""
    d = {k: pattern.to_dict()[k] for k in ("segment_lengths", "dilation_rates", "query_dilation",
                                           "sink_tokens", "window")}
    return zlib.crc32(json.dumps(d, sort_keys=True).encode())


def _agree(q, k, v, pattern, causal, scale, qp, kp, kd, group, cached: bool = False) -> bool:
    """All-gather a small descriptor; raise the same ``ValueError`` on every rank on mismatch.

    Also gathers each rank's ``cached`` flag (its inputs equal those of its cached plan) and
    returns True only if every rank has it, so all ranks take the same branch.
    """
    import torch.distributed as dist

    meta = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
            int(causal), _pattern_crc(pattern),
            struct.unpack("<q", struct.pack("<d", float(scale)))[0],
            _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, qp.shape[0], kp.shape[0],
            int(kd is not None), -1 if kd is None else kd.shape[0], int(q.is_cuda)]
    t = torch.tensor(meta + [int(cached)], dtype=torch.int64, device=q.device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    table = torch.stack(out).cpu()
    all_cached = bool(table[:, -1].all())
    table = table[:, :-1]
    bad = [i for i in range(len(meta)) if not bool((table[:, i] == table[0, i]).all())]
    if bad:
        lines = []
        for i in bad:
            vals = ", ".join(f"rank {r}: {int(table[r, i])}" for r in range(table.shape[0]))
            lines.append(f"{_META_FIELDS[i]} ({vals})")
        raise ValueError(
            "ring_attention: the ranks of the sequence-parallel group disagree on "
            + "; ".join(lines) + f". Every rank must call it with equal shard shapes, pattern, "
            f"dtype and options (this rank: q {tuple(q.shape)}, k {tuple(k.shape)}, {pattern}); "
            "pad the sequence with shard_batch(...) so it divides the group.")
    return all_cached


def _positions(name, t, batch, length, device):
    if t is None:
        raise ValueError(f"ring_attention needs {name} (the true positions of this rank's shard), "
                         "got None")
    t = torch.as_tensor(t, device=device)
    if t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] != length or t.shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape [{length}] or [1 or {batch}, {length}], "
                         f"got {tuple(t.shape)}")
    t = t.to(torch.int64).expand(batch, -1)  # one batch convention on every rank
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0 (true positions), got min {int(t.min())}")
    return t.contiguous()


def _all_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


# ---------------------------------------------------------------------------------- compute
def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 accumulation (float64 inputs keep float64, so fp64 tests compare exactly)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _neg_inf_safe(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf replaced by 0, so ``exp(y - safe(x))`` is 0 (not NaN) for empty rows."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


# ---------------------------------------------------------------------------------- pieces
MAX_RUNS = 16  # more runs of consecutive positions than this: one mapped call per block


def _runs(pos: torch.Tensor):
    """Maximal storage ranges of consecutive positions ``[(lo, hi, first position)]`` when every
    batch row has the same positions and there are at most ``MAX_RUNS``; else None."""
    if pos.shape[1] == 0:
        return []
    if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
        return None
    p = pos[0]
    cuts = (torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()
    if len(cuts) + 1 > MAX_RUNS:
        return None
    bounds = [0] + cuts + [p.numel()]
    first = p[torch.tensor(bounds[:-1], device=p.device)].tolist()
    return [(lo, hi, f) for lo, hi, f in zip(bounds[:-1], bounds[1:], first)]


def _interacts(pattern: DilatedPattern, causal: bool, q_rng, k_rng) -> bool:
    """Whether the query and key position ranges ``[lo, hi]`` can hold an allowed pair: some
    config's segment holds positions of both (sliding windows: the ranges come within ``w``),
    or the key range holds a sink; and, causal, some key is not after some query. A superset
    test (classes and documents are ignored), so no allowed pair is dropped."""
    (qa, qb), (ka, kb) = q_rng, k_rng
    if causal and ka > qb:
        return False
    if ka < pattern.sink_tokens:  # its first key is a sink (ka is a key's position)
        return True
    if pattern.sliding:  # the closest pair of the two ranges is within the longest window
        gap = max(qa - kb, 0) if causal else max(qa - kb, ka - qb, 0)
        return gap < pattern.max_segment
    return any(max(qa // w, ka // w) <= min(qb // w, kb // w) for w in pattern.segment_lengths)


@dataclass
class _Piece:
    """One ``dilated_attention`` call of a ring step: query rows ``[qs, qe)`` against key rows
    ``[ks, ke)`` of the step's block."""

    qs: int
    qe: int
    ks: int
    ke: int
    run: int  # index of the query run (accumulator slot)
    # ops.position_plan of this piece's positions (a PositionPlan without document ids, or
    # False: not plannable), made on its first call that goes to the kernels and kept with the
    # cached ring plan: later layers and the backward plan nothing again
    plan: object = field(default=None, compare=False, repr=False)


def _run_ranges(pos: torch.Tensor):
    """``[(lo, hi, (first, last position))]``: the runs of :func:`_runs`, or the whole shard as
    one range when it has too many runs (then ``(first, last)`` are its min and max)."""
    runs = _runs(pos)
    if runs is None:
        runs = [(0, pos.shape[1], None)]
    return [(lo, hi, (f, f + hi - lo - 1) if f is not None
             else (int(pos[:, lo:hi].min()), int(pos[:, lo:hi].max()))) for lo, hi, f in runs]


def _plan_pieces(pattern, causal, plan: RingPlan, q_pos, k_pos):
    """Pieces of every step, the query runs, and how many pieces write each query run.

    Query rows are split into runs of consecutive positions; the local block (step 0) is split
    into key runs too, so a contiguous or zigzag shard runs the kernels on consecutive
    positions (no position table, no masks beyond the pattern's) and skips run pairs that no
    segment joins. A received block (rows chosen by the send plan) stays one call per query
    run whose positions its key range can reach.
    """
    qruns = _run_ranges(q_pos)

    def reach(ks, ke, krng):
        return [_Piece(qs, qe, ks, ke, i) for i, (qs, qe, qrng) in enumerate(qruns)
                if _interacts(pattern, causal, qrng, krng)]

    pieces = [[pc for ks, ke, krng in _run_ranges(k_pos) for pc in reach(ks, ke, krng)]]
    for st in plan.steps:
        kp = st.recv_kpos
        pieces.append(reach(0, kp.shape[1], (int(kp.min()), int(kp.max()))) if st.n_recv else [])
    writes = [0] * len(qruns)
    for step in pieces:
        for pc in step:
            writes[pc.run] += 1
    return pieces, qruns, writes


@dataclass
class _Ctx:
    pattern: DilatedPattern
    causal: bool
    scale: float
    group: object
    plan: RingPlan
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_doc: Optional[torch.Tensor]
    k_doc: Optional[torch.Tensor]
    backend: str
    pieces: list  # per step: [_Piece]
    qruns: list  # [(lo, hi, (first, last position))]
    writes: list  # pieces per query run


def _block_inputs(ctx: _Ctx, xchg: _KVExchange, j: int, k, v):
    """(k_blk, v_blk, k_positions, k_doc_ids) of step ``j``, or None when the step is empty."""
    if j == 0:
        return k, v, ctx.k_pos, ctx.k_doc
    blk = xchg.block(j)
    if blk is None:
        return None
    st = ctx.plan.steps[j - 1]
    return blk[0], blk[1], st.recv_kpos, st.recv_kdoc


def _piece_args(ctx: _Ctx, pc: _Piece, kpos, kdoc, q, k, v):
    rq, rk = slice(pc.qs, pc.qe), slice(pc.ks, pc.ke)
    qp, kp = ctx.q_pos[:, rq], kpos[:, rk]
    if pc.plan is None:  # None again when this call does not go to the kernels
        pc.plan = position_plan(q, k, v, ctx.pattern, q_positions=qp, k_positions=kp,
                                backend=ctx.backend)
    qd = None if kdoc is None else ctx.q_doc[:, rq]
    kd = None if kdoc is None else kdoc[:, rk]
    return dict(pattern=ctx.pattern, causal=ctx.causal, scale=ctx.scale, q_positions=qp,
                k_positions=kp, q_doc_ids=qd, k_doc_ids=kd, backend=ctx.backend,
                plan=with_documents(pc.plan, qd, kd))


def _ring_forward(ctx: _Ctx, q, k, v):
    """Merged ``(out [B, Hq, Sq, Dv] in q.dtype, lse [B, Hq, Sq] float32)``.

    A query run written by one piece takes it as it is; runs written by several merge in float32
    buffers of their own rows only. Rows no piece reaches keep ``out = 0, lse = -inf``.
    """
    world = ctx.plan.world
    acc_dtype = _acc_dtype(q)
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    accs = {}  # run -> (acc, lse) float32 of its rows
    xchg = _KVExchange(k, v, ctx.plan, ctx.group)
    xchg.post(1)
    for j in range(world):
        xchg.post(j + 1)  # next step's transfer runs while this step computes
        blk = _block_inputs(ctx, xchg, j, k, v)
        if blk is None:
            continue
        kb, vb, kpos, kdoc = blk
        for pc in ctx.pieces[j]:
            rq, rk = slice(pc.qs, pc.qe), slice(pc.ks, pc.ke)
            qb, kb_, vb_ = q[:, :, rq], kb[:, :, rk], vb[:, :, rk]
            args = _piece_args(ctx, pc, kpos, kdoc, qb, kb_, vb_)
            if ctx.writes[pc.run] == 1:  # the run's only piece: straight into the result
                attention_forward_into(qb, kb_, vb_, out=out[:, :, rq], lse=lse[:, :, rq],
                                       **args)
                continue
            o_b, l_b = attention_forward_into(
                qb, kb_, vb_, out=qb.new_empty(qb.shape[:3] + (vb_.shape[-1],)),
                lse=qb.new_empty(qb.shape[:3], dtype=torch.float32), **args)
            o_b, l_b = o_b.to(acc_dtype), l_b.to(acc_dtype)
            if pc.run not in accs:
                accs[pc.run] = (o_b, l_b)
                continue
            acc, m = accs[pc.run]
            new = torch.logaddexp(m, l_b)
            ref = _neg_inf_safe(new)
            accs[pc.run] = (acc * torch.exp(m - ref).unsqueeze(-1)
                            + o_b * torch.exp(l_b - ref).unsqueeze(-1), new)
    for run, (acc, m) in accs.items():
        lo, hi, _ = ctx.qruns[run]
        out[:, :, lo:hi] = acc.to(q.dtype)
        lse[:, :, lo:hi] = m.to(torch.float32)
    return out, lse


def _ring_backward(ctx: _Ctx, q, k, v, out, lse, dout, dlse):
    """``(dq, dk, dv)`` of the ring forward: each piece's gradient from the merged
    ``(out, lse)`` (:func:`~hf_hilbert_attn.ops.dilated_attention_backward`), summed."""
    from .ops import dilated_attention_backward

    world = ctx.plan.world
    acc = _acc_dtype(q)
    dq = torch.zeros_like(q)
    dq_acc = {}  # run -> float32 dq of its rows (runs with several pieces)
    remote_grads = any(st.n_send for st in ctx.plan.steps)
    local_cover = torch.zeros(k.shape[2], dtype=torch.int32)
    for pc in ctx.pieces[0]:
        local_cover[pc.ks:pc.ke] += 1
    # dK/dV straight in the input dtype when every key row gets at most one local piece and
    # nothing comes back from other ranks; else float32 accumulators
    direct_kv = not remote_grads and (local_cover.numel() == 0 or int(local_cover.max()) <= 1)
    kv_dtype = k.dtype if direct_kv else acc
    dk = torch.zeros(k.shape, dtype=kv_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=kv_dtype, device=v.device)
    xchg = _KVExchange(k, v, ctx.plan, ctx.group)
    xchg.post(1)
    grads_in = []  # (works, dk_in, dv_in, step, keep-alive)
    for j in range(world):
        xchg.post(j + 1)
        blk = _block_inputs(ctx, xchg, j, k, v)
        gk_blk = gv_blk = None
        if blk is not None:
            kb, vb, kpos, kdoc = blk
            for pc in ctx.pieces[j]:
                rq, rk = slice(pc.qs, pc.qe), slice(pc.ks, pc.ke)
                direct_q = ctx.writes[pc.run] == 1
                direct_k = j == 0 and direct_kv
                # a run's only piece writes its dq rows in place; local keys whose only
                # gradient is this piece's likewise
                qb, kb_, vb_ = q[:, :, rq], kb[:, :, rk], vb[:, :, rk]
                gq, gk, gv = dilated_attention_backward(
                    dout[:, :, rq], qb, kb_, vb_, out[:, :, rq], lse[:, :, rq],
                    dlse=None if dlse is None else dlse[:, :, rq],
                    dq=dq[:, :, rq] if direct_q else None,
                    dk=dk[:, :, rk] if direct_k else None,
                    dv=dv[:, :, rk] if direct_k else None,
                    **_piece_args(ctx, pc, kpos, kdoc, qb, kb_, vb_))
                if not direct_q:
                    if pc.run in dq_acc:
                        dq_acc[pc.run] += gq.to(acc)
                    else:
                        dq_acc[pc.run] = gq.to(acc)
                if j == 0:
                    if not direct_kv:
                        dk[:, :, rk] += gk.to(acc)
                        dv[:, :, rk] += gv.to(acc)
                    continue
                if gk_blk is None:
                    gk_blk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
                    gv_blk = torch.zeros(vb.shape, dtype=acc, device=vb.device)
                gk_blk[:, :, rk] += gk.to(acc)
                gv_blk[:, :, rk] += gv.to(acc)
        if j == 0:
            continue
        # Send this block's dK/dV to the rank owning those keys and receive ours from dst, in
        # the same step on every rank, so each pair of ranks posts its ops in the same order
        # (NCCL matches point-to-point ops by order, not by tag).
        st = ctx.plan.steps[j - 1]
        sends = []
        if blk is not None:
            if gk_blk is None:  # received keys no piece reached: their gradient is 0
                gk_blk = torch.zeros(blk[0].shape, dtype=acc, device=k.device)
                gv_blk = torch.zeros(blk[1].shape, dtype=acc, device=k.device)
            sends = [(_entries_of_block(gk_blk, st), st.src, 4 * j + 2),
                     (_entries_of_block(gv_blk, st), st.src, 4 * j + 3)]
        grads_in.append(_post_grad_recv(st, j, k, v, sends, ctx.group))
        if len(grads_in) > 1:  # keep at most two steps of gradient buffers alive
            _add_grads(dk, dv, grads_in.pop(0))
    for entry in grads_in:
        _add_grads(dk, dv, entry)
    for run, g in dq_acc.items():
        lo, hi, _ = ctx.qruns[run]
        dq[:, :, lo:hi] = g.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _add_grads(dk, dv, entry):
    """Wait for one step's gradient exchange and add what came back into our dK/dV."""
    works, gk_in, gv_in, st, _ = entry
    for w in works:
        w.wait()
    if gk_in is None:
        return
    if st.send_dense:
        b, _, d = gk_in.shape
        dk.index_add_(2, st.send_rows, gk_in.view(b, -1, st.send_rows.numel(), d))
        dv.index_add_(2, st.send_rows, gv_in.view(b, -1, st.send_rows.numel(), gv_in.shape[-1]))
    else:
        # [B, Hkv, S, D] viewed as [Hkv, S, B, D] so the (head, row) pairs index dims 0, 1
        idx = (st.send_head, st.send_row)
        dk.permute(1, 2, 0, 3).index_put_(idx, gk_in.transpose(0, 1), accumulate=True)
        dv.permute(1, 2, 0, 3).index_put_(idx, gv_in.transpose(0, 1), accumulate=True)


def _post_grad_recv(st: _Step, j, k, v, sends, group):
    gk_in = gv_in = None
    acc = _acc_dtype(k)
    recvs = []
    if st.n_send:
        b = k.shape[0]
        gk_in = torch.empty(b, st.n_send, k.shape[-1], dtype=acc, device=k.device)
        gv_in = torch.empty(b, st.n_send, v.shape[-1], dtype=acc, device=v.device)
        recvs = [(gk_in, st.dst, 4 * j + 2), (gv_in, st.dst, 4 * j + 3)]
    return _post(sends, recvs, group), gk_in, gv_in, st, sends


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx):
        out, lse = _ring_forward(ctx, q, k, v)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring = ctx
        fctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(fctx, dout, dlse):
        saved = fctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        with torch.autocast(saved[0].device.type, enabled=False):
            return _RingAttention._backward(fctx, saved, dout, dlse)

    @staticmethod
    def _backward(fctx, saved, dout, dlse):
        q, k, v, out, lse = saved
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(fctx.ring, q, k, v, out, lse, dout, dlse)
        return dq, dk, dv, None


def _under_autocast(fn, q, k, v, pattern, kw):
    """Under ``torch.autocast``: ``fn`` on inputs cast to the autocast dtype, with autocast off
    (as :func:`~hf_hilbert_attn.dilated_attention` does); else None."""
    dt = autocast_dtype(q) if isinstance(q, torch.Tensor) else None
    if dt is None:
        return None
    with torch.autocast(q.device.type, enabled=False):
        return fn(*cast_for_autocast(dt, q, k, v), pattern, **kw)


def _shard_inputs(q, k, v, pattern, q_positions, k_positions, scale, q_doc_ids, k_doc_ids):
    """Checked ``(B, Hq, Hkv, scale, q_pos, k_pos, q_doc, k_doc)`` of a shard's call."""
    if not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, H, S, D], got {got}")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    scale = d ** -0.5 if scale is None else float(scale)
    qp = _positions("q_positions", q_positions, b, sq, q.device)
    kp = _positions("k_positions", k_positions, b, sk, q.device)
    if q_doc_ids is None and k_doc_ids is not None and sq == sk:
        q_doc_ids = k_doc_ids
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    qd = kd = None
    if k_doc_ids is not None:
        qd = torch.as_tensor(q_doc_ids, device=q.device).to(torch.int64)
        kd = torch.as_tensor(k_doc_ids, device=q.device).to(torch.int64)
        qd = qd.unsqueeze(0) if qd.dim() == 1 else qd
        kd = kd.unsqueeze(0) if kd.dim() == 1 else kd
        if kd.shape[-1] != sk or qd.shape[-1] != sq or qd.dim() != 2 or kd.dim() != 2:
            raise ValueError(f"doc ids must match the shard lengths ({sq}, {sk}), got "
                             f"{tuple(qd.shape)} and {tuple(kd.shape)}")
        qd, kd = qd.expand(b, -1).contiguous(), kd.expand(b, -1).contiguous()
    return b, hq, hkv, scale, qp, kp, qd, kd


def local_attention(q, k, v, pattern, *, q_positions, k_positions, causal=True, scale=None,
                    q_doc_ids=None, k_doc_ids=None, return_lse=False, backend="auto"):
    """A shard's attention to its own keys only, computed as ring attention computes its local
    step: per run of consecutive positions (no position tables for contiguous or zigzag
    shards). Equals :func:`~hf_hilbert_attn.dilated_attention` with the same positions; what a
    ring rank would cost with nothing to exchange (``bench_ring.py``'s shard-alone ideal).
    Arguments and result as in :func:`ring_attention` without ``group``."""
    kw = dict(q_positions=q_positions, k_positions=k_positions, causal=causal, scale=scale,
              q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, return_lse=return_lse, backend=backend)
    done = _under_autocast(local_attention, q, k, v, pattern, kw)
    if done is not None:
        return done
    _, _, hkv, scale, qp, kp, qd, kd = _shard_inputs(q, k, v, pattern, q_positions, k_positions,
                                                     scale, q_doc_ids, k_doc_ids)
    plan = RingPlan(0, 1, hkv)
    pieces, qruns, writes = _plan_pieces(pattern, causal, plan, qp, kp)
    ctx = _Ctx(pattern, causal, scale, None, plan, qp, kp, qd, kd, backend, pieces, qruns,
               writes)
    out, lse = _RingAttention.apply(q, k, v, ctx)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------- public
_PLAN_CACHE = {}  # the last plan: {"key", "inputs": (q_pos, k_pos, k_doc), "plan"}

def ring_attention(q, k, v, pattern, *, group, q_positions, k_positions, causal=True, scale=None,
                   q_doc_ids=None, k_doc_ids=None, return_lse=False, backend="auto"):
    """Dilated attention over a sequence sharded across the ranks of ``group``.

    Every rank calls this with its shard; all ranks must agree on shapes, pattern and options.

    Args:
        q: ``[B, Hq, Sq, D]`` queries of this rank's tokens.
        k, v: ``[B, Hkv, Sk, D]`` keys/values of this rank's tokens (``Hq % Hkv == 0``).
        pattern: the :class:`~hf_hilbert_attn.DilatedPattern`.
        group: the sequence-parallel process group (None or size 1: plain
            :func:`~hf_hilbert_attn.dilated_attention`).
        q_positions, k_positions: true positions ``[S]`` or ``[B, S]`` (int, >= 0) of this
            rank's queries and keys in the full sequence. Required.
        causal, scale: as in :func:`~hf_hilbert_attn.dilated_attention`.
        q_doc_ids, k_doc_ids: document ids of this rank's tokens, ``[S]`` or ``[B, S]``; a
            negative key id is padding.
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Sq]``.
        backend: forwarded to ``dilated_attention`` for every block.

    Returns:
        ``out`` ``[B, Hq, Sq, D]`` (rows of the full-sequence attention for this rank's queries),
        and ``lse`` if ``return_lse``.

    Raises:
        ValueError: bad shapes / positions, or (on every rank) ranks that disagree on shapes,
            pattern, dtype or options.
    """
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return dilated_attention(q, k, v, pattern, causal=causal, scale=scale,
                                 q_positions=q_positions, k_positions=k_positions,
                                 q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                                 return_lse=return_lse, backend=backend)
    kw = dict(q_positions=q_positions, k_positions=k_positions, causal=causal, scale=scale,
              q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, return_lse=return_lse, backend=backend)
    done = _under_autocast(ring_attention, q, k, v, pattern, dict(kw, group=group))
    if done is not None:
        return done
    _, hq, hkv, scale, qp, kp, qd, kd = _shard_inputs(q, k, v, pattern, q_positions, k_positions,
                                                      scale, q_doc_ids, k_doc_ids)
    # Every layer of a model calls this with the same positions: reuse the plan when every rank
    # still has the inputs it was made from (compared by value; one flag per rank in _agree).
    key = (id(group), pattern, hq, hkv, bool(causal), q.device)
    hit = _PLAN_CACHE.get("key") == key and all(
        (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                      and bool(torch.equal(a, b)))
        for a, b in zip((qp, kp, kd), _PLAN_CACHE.get("inputs", (None,) * 3)))
    if _agree(q, k, v, pattern, causal, scale, qp, kp, kd, group, cached=hit):
        plan = _PLAN_CACHE["plan"]
    else:
        rank = dist.get_rank(group)
        all_qp = _all_gather(qp, group)
        all_kp = _all_gather(kp, group)
        all_kd = None if kd is None else _all_gather(kd, group)
        plan = plan_ring(pattern, hq, hkv, causal, rank, all_qp, all_kp, all_kd)
        _PLAN_CACHE.clear()
        _PLAN_CACHE.update(key=key, inputs=(qp.clone(), kp.clone(),
                                            None if kd is None else kd.clone()), plan=plan,
                           pieces=_plan_pieces(pattern, causal, plan, qp, kp))
    pieces, qruns, writes = _PLAN_CACHE["pieces"]
    ctx = _Ctx(pattern, causal, scale, group, plan, qp, kp, qd, kd, backend, pieces, qruns,
               writes)
    out, lse = _RingAttention.apply(q, k, v, ctx)
    return (out, lse) if return_lse else out
