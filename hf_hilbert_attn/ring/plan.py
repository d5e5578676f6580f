"""The ring's send plan and pieces: pure functions of the ranks' positions (no process group).

* :func:`key_need` — which ``(kv head, key row)`` entries some query can attend (a superset of
  the allowed pairs: documents are ignored). The pattern's rule evaluated per (segment, class)
  bucket, per class and window for sliding windows, plus the sink tokens; O(S), no S².
* :func:`plan_ring` — per ring step, what one rank sends and receives. Sender and receiver
  compute the same plan from the same all-gathered positions, so no sizes are exchanged.
* :func:`plan_pieces` — each step as calls over runs of consecutive positions (no tables).
* :class:`PlanCache` — the last plan per process group, reused while positions are unchanged.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import torch

from ..engines.passes import _lex_order, _lex_search
from ..pattern import DilatedPattern
from ..planning import meets

if TYPE_CHECKING:  # pragma: no cover
    from ..kernels._plan import PositionPlan

__all__ = ["key_need", "Step", "RingPlan", "plan_ring", "MAX_RUNS", "run_ranges", "Piece",
           "Pieces", "plan_pieces", "CachedPlan", "PlanCache"]


# ---------------------------------------------------------------------------------- send plan
def key_need(pattern: DilatedPattern, hq: int, hkv: int, causal: bool,
             q_pos: torch.Tensor, k_pos: torch.Tensor, head_base: int = 0) -> torch.Tensor:
    """Which ``(kv head, key row)`` some query can attend: bool ``[Hkv, Sk]``. ``q_pos`` ``[Bq,
    Sq]``, ``k_pos`` ``[Bk, Sk]`` (int64, >= 0). A key is needed if, for some
    config, a query of its batch entry is in its (segment, class) bucket (sliding: its class,
    within ``w``), not before it (causal), of a class some query head of the kv head uses
    (per_head); or if it is a sink some query is not before. Exactly ``pattern.build_mask``'s
    pairs but for documents (ignored: a superset is all a send plan needs). No S² work.
    ``head_base``: query head ``h`` uses the classes of head ``head_base + h`` (a head shard's).
    """
    dev = k_pos.device
    b = max(q_pos.shape[0], k_pos.shape[0])
    qp, kp = q_pos.expand(b, -1), k_pos.expand(b, -1)
    need = torch.zeros(hkv, kp.shape[1], dtype=torch.bool, device=dev)
    if qp.numel() == 0 or kp.numel() == 0:
        return need
    hi = int(torch.maximum(qp.max(), kp.max())) + 1
    heads_of_kv = torch.arange(head_base, head_base + hq, device=dev).view(hkv, hq // hkv)
    for i, (w, r) in enumerate(pattern.configs):
        kseg, kcls = pattern.segment_and_class(i, kp)
        if pattern.sliding:
            ok = _window_reach(qp, kp, w, r, causal)  # [B, Sk]
        else:
            nb = (hi // w + 1) * r  # (segment, class) buckets per batch entry
            off = (torch.arange(b, device=dev) * nb).unsqueeze(1)
            qseg, qcls = pattern.segment_and_class(i, qp)
            qb = (qseg * r + qcls + off).flatten()
            kb = kseg * r + kcls + off  # [B, Sk]
            # latest query position per bucket (-1: none); a key is reachable iff it is not
            # after it (non-causal: iff there is one; positions are >= 0)
            latest = torch.full((b * nb,), -1, dtype=torch.int64, device=dev)
            latest.scatter_reduce_(0, qb, qp.flatten(), reduce="amax")
            ok = latest[kb] >= (kp if causal else 0)  # [B, Sk]
        if pattern.query_dilation == "per_head" and r > 1:
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


def _window_reach(qp: torch.Tensor, kp: torch.Tensor, w: int, r: int,
                  causal: bool) -> torch.Tensor:
    """bool ``[B, Sk]``: some query of the key's batch entry and class ``p ≡ s (mod r)`` lies
    in ``[s, s + w - 1]`` (non-causal ``[s - w + 1, s + w - 1]``). One search per key among
    the queries sorted by (batch entry, class, position): ``passes._lex_search``, which also
    takes positions too far apart for one search key."""
    entry = torch.arange(qp.shape[0], device=qp.device).unsqueeze(1) * r
    qg, kg = ((entry + torch.remainder(p, r)).flatten() for p in (qp, kp))
    order = _lex_order(qg, qp.flatten())
    qg, qs = qg.index_select(0, order), qp.flatten().index_select(0, order)
    idx = _lex_search(qg, qs, kg, kp.flatten() - (0 if causal else w - 1), right=False)
    at = idx.clamp(max=qs.numel() - 1)
    return ((idx < qs.numel()) & (qg[at] == kg) & (qs[at] <= kp.flatten() + (w - 1))).view(
        kp.shape)


@dataclass
class Step:
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
    steps: List[Step] = field(default_factory=list)  # steps 1..world-1

    def entries_sent(self) -> int:
        """(kv head, row) entries this rank sends per tensor (K or V) in one forward."""
        return sum(s.n_send for s in self.steps)


def _entries(need: torch.Tensor):
    """(heads, rows, distinct rows, dense?) of a need mask ``[Hkv, S]``."""
    rows = need.any(0).nonzero().flatten()
    head, row = need.nonzero(as_tuple=True)
    return head, row, rows, head.numel() == need.shape[0] * rows.numel()


def plan_ring(pattern: DilatedPattern, hq: int, hkv: int, causal: bool, rank: int,
              q_positions: List[torch.Tensor], k_positions: List[torch.Tensor],
              k_doc_ids: Optional[List[torch.Tensor]] = None, skip_kv_heads=(),
              head_base: int = 0) -> RingPlan:
    """The ring plan of ``rank`` given every rank's positions.

    Args:
        pattern, hq, hkv, causal: the attention being computed.
        rank: the group rank to plan for.
        q_positions, k_positions: per group rank, ``[Bp, S]`` int64 true positions.
        k_doc_ids: per group rank ``[Bd, S]`` or None.
        skip_kv_heads: key/value heads whose results are discarded (dense heads): not sent.
        head_base: the number of query head 0 in the pattern's rule (a head shard's).

    Returns:
        A :class:`RingPlan`, a pure function of its arguments: sender and receiver compute
        matching halves of each exchange without exchanging sizes.
    """
    world = len(k_positions)
    plan = RingPlan(rank, world, hkv)

    def need(qp, kp):  # skipped heads' results are discarded: their keys are not sent
        return key_need(pattern, hq, hkv, causal, qp, kp, head_base).index_fill_(
            0, torch.tensor(skip_kv_heads, dtype=torch.long, device=kp.device), False)
    for j in range(1, world):
        dst, src = (rank + j) % world, (rank - j) % world
        sh, sr, srows, sdense = _entries(need(q_positions[dst], k_positions[rank]))
        need_in = need(q_positions[rank], k_positions[src])
        rh, rr, rrows, rdense = _entries(need_in)
        slot_of_row = torch.cumsum(need_in.any(0), 0) - 1
        plan.steps.append(Step(
            j, dst, src, sh, sr, sdense, srows, rh, slot_of_row[rr], rdense, rrows,
            k_positions[src].index_select(1, rrows),
            None if k_doc_ids is None else k_doc_ids[src].index_select(1, rrows)))
    return plan


# ---------------------------------------------------------------------------------- pieces
MAX_RUNS = 16  # more runs of consecutive positions than this: one mapped call per block


def _runs(pos: torch.Tensor):
    """Storage ranges of consecutive positions ``[(lo, hi, first position)]``, or None when batch
    rows differ or there are more than ``MAX_RUNS``."""
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


def run_ranges(pos: torch.Tensor) -> List[Tuple[int, int, Tuple[int, int]]]:
    """``[(lo, hi, (first, last position))]``: the storage ranges of ``pos`` ``[Bp, S]`` holding
    consecutive positions, else (:func:`_runs` None) the whole shard with its min and max."""
    runs = _runs(pos)
    runs = [(0, pos.shape[1], None)] if runs is None else runs
    return [(lo, hi, (f, f + hi - lo - 1) if f is not None
             else (int(pos[:, lo:hi].min()), int(pos[:, lo:hi].max()))) for lo, hi, f in runs]


def _query_span(pattern: DilatedPattern, causal: bool, k_rng: Tuple[int, int]) -> Tuple[int, int]:
    """The positions ``[lo, hi]`` outside which no query has an allowed pair with a key in
    ``k_rng`` (a superset: classes are ignored): within the longest window of a key (sliding),
    in a segment holding a key (segments), anywhere after a sink; causal: not before the
    first key."""
    ka, kb = k_rng
    if ka < pattern.sink_tokens:
        lo, hi = -(1 << 62), 1 << 62
    elif pattern.sliding:
        lo, hi = ka - pattern.max_segment + 1, kb + pattern.max_segment - 1
    else:
        lo = min(ka // w * w for w in pattern.segment_lengths)
        hi = max((kb // w + 1) * w - 1 for w in pattern.segment_lengths)
    return (max(lo, ka) if causal else lo), hi


@dataclass(eq=False)
class Piece:
    """One call of a ring step: query rows ``[qs, qe)`` (of run ``run``, those that can reach the
    keys) against key rows ``[ks, ke)`` of the step's block; the kernels' position plan is kept
    here from the first kernel call (``kernel_plan``: None before it, False where the kernels
    cannot take these positions: the PyTorch path)."""

    qs: int
    qe: int
    ks: int
    ke: int
    run: int  # index of the query run (accumulator slot)
    kernel_plan: Union["PositionPlan", bool, None] = field(default=None, repr=False)


@dataclass
class Pieces:
    """The pieces of every ring step of one rank (see :func:`plan_pieces`)."""

    steps: List[List[Piece]]  # per step j (0 = the local keys): its pieces
    qruns: List[Tuple[int, int, Tuple[int, int]]]  # the query runs: (lo, hi, (first, last))
    writes: List[int]  # pieces per query run (1: written in place, no merge buffer)


def plan_pieces(pattern: DilatedPattern, causal: bool, plan: RingPlan, q_pos: torch.Tensor,
                k_pos: torch.Tensor) -> Pieces:
    """Pieces of every step, the query runs, and how many pieces write each query run.

    Query rows and key blocks (local and received) are split into runs of consecutive
    positions: contiguous and zigzag shards run the kernels in natural order and skip run pairs
    no segment or window joins (a sink apart from far window keys: not a spread-out call).
    """
    qruns = run_ranges(q_pos)
    consecutive = _runs(q_pos) is not None  # run rows hold positions first, first + 1, ...

    def reach(ks, ke, krng):
        out = []
        for i, (qs, qe, qrng) in enumerate(qruns):
            if not meets(pattern, causal, qrng, krng):
                continue
            if consecutive:  # only the rows whose positions can reach the keys
                lo, hi = _query_span(pattern, causal, krng)
                qs, qe = max(qs, qs + lo - qrng[0]), min(qe, qs + hi - qrng[0] + 1)
                if qs >= qe:
                    continue
            out.append(Piece(qs, qe, ks, ke, i))
        return out

    steps = [[pc for ks, ke, krng in run_ranges(kp) for pc in reach(ks, ke, krng)]
             for kp in [k_pos] + [st.recv_kpos for st in plan.steps]]
    runs = Counter(pc.run for step in steps for pc in step)
    return Pieces(steps, qruns, [runs[i] for i in range(len(qruns))])


# ---------------------------------------------------------------------------------- cache
@dataclass
class CachedPlan:
    """A plan with what it was made from (besides its key in :class:`PlanCache`: pattern, heads,
    causal, device, ...): the positions and key document ids ``(q_pos, k_pos, k_doc)``."""

    inputs: Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
    plan: RingPlan
    pieces: Pieces

    def matches(self, inputs) -> bool:
        """The same inputs, compared by value."""
        return all(a is b is None or (a is not None and b is not None and bool(torch.equal(a, b)))
                   for a, b in zip(inputs, self.inputs))


class PlanCache:
    """The last plans per process group (held weakly), one per key (pattern, heads, causal,
    device; a layer with dense heads runs a sparse and a dense ring), at most ``PER_GROUP``.
    Every layer calls the ring with the same positions, so the first layer's plan serves the
    others; a rank uses it only if every rank still has its inputs (one flag per rank in the
    agreement), so all ranks take the same branch.
    """

    PER_GROUP = 4

    def __init__(self):
        self._by_group = weakref.WeakKeyDictionary()

    def lookup(self, group, key: tuple, inputs) -> Optional[CachedPlan]:
        """The group's cached plan if it was made for ``key`` and equal ``inputs``, else None."""
        entry = self._by_group.get(group, {}).get(key)
        return entry if entry is not None and entry.matches(inputs) else None

    def store(self, group, key: tuple, inputs, plan: RingPlan, pieces: Pieces) -> CachedPlan:
        """Keep ``plan`` as the group's plan for ``key`` (copies of ``inputs``: callers may change
        theirs)."""
        kept = tuple(None if t is None else t.clone() for t in inputs)
        plans = self._by_group.setdefault(group, {})
        plans.pop(key, None)
        while len(plans) >= self.PER_GROUP:
            plans.pop(next(iter(plans)))  # the oldest key
        return plans.setdefault(key, CachedPlan(kept, plan, pieces))  # (popped above)

    def get(self, group) -> Optional[CachedPlan]:
        """The group's last plan, whatever it was made for (None if none)."""
        plans = self._by_group.get(group)
        return next(reversed(plans.values())) if plans else None

    def __len__(self) -> int:
        """Groups with a plan."""
        return len(self._by_group)
