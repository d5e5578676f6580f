"""The ring's communication: the active group (:func:`sequence_parallel`), the agreement
(:func:`agree`: disagreeing ranks raise on *every* rank instead of hanging), the weak group
reference and the point-to-point exchanges (:class:`KVExchange`, :class:`GradExchange`).

Tags: step ``j`` sends K, V, dK, dV as ``4j .. 4j + 3``; NCCL matches point-to-point operations
by order, so every pair of ranks posts them in the same order (one step at a time).
"""

from __future__ import annotations

import contextlib
import struct
import weakref
import zlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .plan import RingPlan, Step

__all__ = ["sequence_parallel", "get_sequence_parallel_group", "get_sequence_parallel_mode",
           "MODES", "split_group", "agree", "all_gather",
           "weak_group", "KVExchange", "GradExchange"]

_ACTIVE_GROUP = []


MODES = ("auto", "ring", "ulysses", "hybrid")


@contextlib.contextmanager
def sequence_parallel(group, mode: str = "auto"):
    """Inside this context the registered ``hilbert_dilated`` attention runs over ``group``.

    ``group``: a process group whose ranks each hold one shard of the sequence
    (:func:`hf_hilbert_attn.sharding.shard_batch`), or None (one process). ``mode``:
    ``"ring"`` (keys and values travel around the ranks), ``"ulysses"`` (all-to-all from
    sequence shards to head shards and back: the heads must split over the ranks),
    ``"hybrid"`` (Ulysses within groups of ranks of one node, a ring across them:
    ``ring.ulysses.ulysses_size``) or ``"auto"`` (``ring.ulysses.resolve_mode``). Every mode
    computes the one-process function. Example::

        with hf_hilbert_attn.sequence_parallel(group, mode="ulysses"):
            loss = model(**shard_batch(batch, group)).loss
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _ACTIVE_GROUP.append((group, mode))
    try:
        yield group
    finally:
        _ACTIVE_GROUP.pop()


def get_sequence_parallel_group():
    """The active sequence-parallel group, or None (no context, or a group of size 1)."""
    g = _ACTIVE_GROUP[-1][0] if _ACTIVE_GROUP else None
    return None if g is None or dist.get_world_size(g) == 1 else g


def get_sequence_parallel_mode() -> str:
    """The active context's ``mode`` (``"auto"`` outside any)."""
    return _ACTIVE_GROUP[-1][1] if _ACTIVE_GROUP else "auto"


# (group's ranks, size) -> weak references to this rank's two subgroups: torch's registry owns a
# group until destroy_process_group(); a group kept past that ran its gloo threads into
# interpreter teardown, where a job could hang or abort at exit (tests/test_ring_exit.py)
_SPLITS: dict = {}


def split_group(group, size: int) -> tuple:
    """This rank's two subgroups of ``group``: its ``size`` consecutive ranks, and the ranks at
    its place in the other such blocks. Every rank of the world calls this alike (new process
    groups need the whole world): the subgroups of every rank's ``group`` are made in one order."""
    key = (tuple(dist.get_process_group_ranks(group)), size)
    mine = [ref() for ref in _SPLITS.get(key, ())]
    if not mine or None in mine:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, key[0])
        made = {part: dist.new_group(list(part)) for ranks in sorted(set(everyone))
                for part in ([ranks[i:i + size] for i in range(0, len(ranks), size)]
                             + [ranks[j::size] for j in range(size)])}
        me = key[0].index(dist.get_rank())
        mine = [made[key[0][me // size * size:][:size]], made[key[0][me % size::size]]]
        _SPLITS[key] = [weakref.ref(g) for g in mine]
    return tuple(mine)


# ---------------------------------------------------------------------------------- agreement
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_META_FIELDS = ("batch size", "query heads", "key/value heads", "query shard length",
                "key shard length", "head_dim", "value head_dim", "causal", "pattern (crc32)",
                "scale (float64 bits)", "dtype", "q_positions batch", "k_positions batch",
                "document ids given", "document ids batch", "device type (1 = cuda)")


def agree(q, k, v, pattern, causal, scale, qp, kp, kd, group, cached: bool = False) -> bool:
    """All-gather a small descriptor; raise the same ``ValueError`` on every rank on mismatch.
    Returns whether every rank's ``cached`` flag (inputs equal its cached plan's) is set."""
    meta = [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
            int(causal), zlib.crc32(repr({**pattern.to_dict(), "ordering": None}).encode()),
            struct.unpack("<q", struct.pack("<d", float(scale)))[0],
            _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, qp.shape[0], kp.shape[0],
            int(kd is not None), -1 if kd is None else kd.shape[0], int(q.is_cuda)]
    t = torch.tensor(meta + [int(cached)], dtype=torch.int64, device=q.device)
    table = torch.stack(all_gather(t, group)).cpu()  # the last column: the cached flags
    if bad := [i for i in range(len(meta)) if not bool((table[:, i] == table[0, i]).all())]:
        lines = [f"{_META_FIELDS[i]} ("
                 + ", ".join(f"rank {r}: {int(x)}" for r, x in enumerate(table[:, i])) + ")"
                 for i in bad]
        raise ValueError(
            "ring_attention: the ranks of the sequence-parallel group disagree on "
            + "; ".join(lines) + f". Every rank must call it with equal shard shapes, pattern, "
            f"dtype and options (this rank: q {tuple(q.shape)}, k {tuple(k.shape)}, {pattern}); "
            "pad the sequence with shard_batch(...) so it divides the group.")
    return bool(table[:, -1].all())


def all_gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    """``t`` of every rank of ``group`` (equal shapes), in group rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


# ---------------------------------------------------------------------------------- exchanges
def weak_group(group) -> Callable[[], Optional[object]]:
    """A weak reference to ``group`` (None: a callable returning None): the ring's autograd
    context lives as long as an output is kept, and a strong reference kept the group's gloo
    threads alive into interpreter teardown, where a job aborted (exit -6; issue 27)."""
    return (lambda: None) if group is None else weakref.ref(group)


def _live(group, plan: RingPlan):
    """``group``, or a clear error where a multi-rank plan lost its group (destroyed between the
    forward and the backward)."""
    if group is None and plan.world > 1:
        raise RuntimeError(
            f"ring attention: the process group of this {plan.world}-rank ring was destroyed "
            "before its exchange (a backward after destroy_process_group()?); run the "
            "backward while the group exists")
    return group


def _post(sends, recvs, group):
    """Post point-to-point ops ``(tensor, group_peer, tag)``; returns the Work handles."""
    ops = [dist.P2POp(op, t, dist.get_global_rank(group, p), group, tag)
           for op, todo in ((dist.isend, sends), (dist.irecv, recvs)) for t, p, tag in todo]
    return dist.batch_isend_irecv(ops) if ops else []


def _scatter_block(flat: torch.Tensor, step: Step, hkv: int) -> torch.Tensor:
    """Received flat entries ``[B, Nr, D]`` -> block ``[B, Hkv, Ur, D]`` (zeros where unsent)."""
    b, _, d = flat.shape
    ur = step.recv_rows.numel()
    if step.recv_dense:
        return flat.view(b, hkv, ur, d)
    block = flat.new_zeros(b, hkv, ur, d)
    block[:, step.recv_head, step.recv_slot] = flat
    return block


class KVExchange:
    """Double-buffered K/V exchange: ``post(j)`` starts step ``j``, ``block(j)`` waits for it."""

    def __init__(self, k, v, plan: RingPlan, group):
        self.k, self.v, self.plan, self.group = k, v, plan, _live(group, plan)
        self.pending = {}

    def post(self, j: int):
        if j >= self.plan.world or j in self.pending:
            return
        st = self.plan.steps[j - 1]  # the entries of local k, v [B, Hkv, S, D] to send: flat
        sends = [((t.index_select(2, st.send_rows).flatten(1, 2) if st.send_dense  # [B, Ns, D]
                   else t[:, st.send_head, st.send_row]).contiguous(), st.dst, 4 * j + n)
                 for n, t in enumerate((self.k, self.v)) if st.n_send]
        kr, vr = (t.new_empty(t.shape[0], st.n_recv, t.shape[-1]) if st.n_recv else None
                  for t in (self.k, self.v))
        recvs = [(t, st.src, 4 * j + n) for n, t in enumerate((kr, vr)) if st.n_recv]
        self.pending[j] = (_post(sends, recvs, self.group), kr, vr, sends)  # sends: kept alive

    def block(self, j: int):
        """``(k_blk, v_blk)`` of step ``j`` (``[B, Hkv, Ur, D]``), or None if nothing comes."""
        works, kr, vr, _ = self.pending.pop(j)
        for w in works:
            w.wait()
        return None if kr is None else tuple(
            _scatter_block(t, self.plan.steps[j - 1], self.plan.hkv) for t in (kr, vr))


class GradExchange:
    """The backward's dK/dV exchange: at step ``j`` a rank sends the gradient of the block it
    received to that block's owner (``src``) and receives the gradient of the keys it sent
    (from ``dst``), both in ``dtype``; at most two steps of buffers stay alive."""

    def __init__(self, dk: torch.Tensor, dv: torch.Tensor, plan: RingPlan, group, dtype):
        self.dk, self.dv, self.plan, self.dtype = dk, dv, plan, dtype
        self.group = _live(group, plan)
        self.pending = []  # (works, dk_in, dv_in, step, keep-alive)

    def step(self, j: int, gk_blk, gv_blk):
        """Post step ``j``: send ``(gk_blk, gv_blk)`` (the received block's gradient, or None
        when nothing was received) and receive ours; adds the oldest step that completed."""
        st = self.plan.steps[j - 1]  # the block's entries, as received (_scatter_block's inverse)
        sends = [((g.flatten(1, 2) if st.recv_dense else g[:, st.recv_head, st.recv_slot])
                  .contiguous(), st.src, 4 * j + 2 + n)
                 for n, g in enumerate((gk_blk, gv_blk)) if gk_blk is not None]
        gk_in, gv_in = (t.new_empty(t.shape[0], st.n_send, t.shape[-1], dtype=self.dtype)
                        if st.n_send else None for t in (self.dk, self.dv))
        recvs = [(g, st.dst, 4 * j + 2 + n) for n, g in enumerate((gk_in, gv_in)) if st.n_send]
        self.pending.append((_post(sends, recvs, self.group), gk_in, gv_in, st, sends))
        if len(self.pending) > 1:  # keep at most two steps of gradient buffers alive
            self._add(self.pending.pop(0))

    def finish(self):
        """Wait for every posted step and add what came back into dK/dV."""
        while self.pending:
            self._add(self.pending.pop(0))

    def _add(self, entry):
        works, gk_in, gv_in, st, _ = entry
        for w in works:
            w.wait()
        if gk_in is None:
            return
        n = st.send_rows.numel()
        for into, g in ((self.dk, gk_in), (self.dv, gv_in)):
            if st.send_dense:
                into.index_add_(2, st.send_rows, g.view(g.shape[0], -1, n, g.shape[-1]))
            else:
                # [B, Hkv, S, D] viewed as [Hkv, S, B, D] so the (head, row) pairs index dims 0, 1
                into.permute(1, 2, 0, 3).index_put_((st.send_head, st.send_row), g.transpose(0, 1),
                                                    accumulate=True)
