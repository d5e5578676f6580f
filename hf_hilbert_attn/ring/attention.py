"""Ring dilated attention: the forward and backward over the plan's steps and pieces.

Each piece (:func:`~hf_hilbert_attn.ring.plan.plan_pieces`) is a call of the backend seam with
the block's true key positions; unsent entries of a received block are zero, never attended.

* **Forward.** Step ``j + 1``'s exchange is posted before step ``j`` is computed; a query run's
  pieces merge into one result (the seam's ``accumulate``: in the kernels); a key counts once.
* **Backward** (custom autograd Function). K/V are re-sent with the same plan; each piece's
  gradient comes from the merged ``(out, lse)``; a received block's dK/dV go back to its rank.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..compiler import disable_lazily
from ..dense_heads import with_dense_heads
from ..inputs import AttnInputs, check_inputs
from ..numerics import accum_dtype, autocast_inputs, autocast_off
from ..backends import select_backend
from ..ops import _EagerKernels, dilated_attention
from ..pattern import DilatedPattern
from .comm import GradExchange, KVExchange, agree, all_gather, weak_group
from .plan import Piece, Pieces, PlanCache, RingPlan, plan_pieces, plan_ring

__all__ = ["ring_attention", "local_attention", "cached_plan"]


@dataclasses.dataclass
class _Ctx:
    pattern: DilatedPattern
    causal: bool
    # the shard's inputs (_shard_inputs): scale, positions [B, S] int64, document ids, the key/value
    # heads whose results the caller discards (dense_heads.py), head_base (ulysses.py), softcap
    a: AttnInputs
    group: Callable[[], object]  # weak_group(...): called for the group, None once destroyed
    plan: RingPlan
    backend: str
    pieces: Pieces

    def forward(self, q, k, v):  # (run by ops._EagerKernels, the kernels' autograd Function)
        return _ring_forward(self, q, k, v)

    def backward(self, dout, dlse, q, k, v, out, lse):
        with torch.autocast(q.device.type, enabled=False):
            return _ring_backward(self, q, k, v, out, lse, dout, dlse)


def _blocks(ctx: _Ctx, k, v):
    """Per ring step ``j``: ``(j, (k_blk, v_blk, k_positions, k_doc_ids))``, or ``(j, None)``
    when the step is empty. Step ``j + 1``'s exchange is posted before step ``j`` is given."""
    xchg = KVExchange(k, v, ctx.plan, ctx.group())
    xchg.post(1)
    yield 0, (k, v, ctx.a.k_positions, ctx.a.k_doc_ids)
    for j, st in enumerate(ctx.plan.steps, 1):
        xchg.post(j + 1)  # next step's transfer runs while this step computes
        blk = xchg.block(j)
        yield j, None if blk is None else (blk[0], blk[1], st.recv_kpos, st.recv_kdoc)


def _piece_call(ctx: _Ctx, pc: Piece, q, blk):
    """``(backend, plan, (q, k, v, pattern, checked inputs, causal), rq, rk)``: a piece's call on
    the backend seam (``backends.py``), its leading arguments, the piece's rows ``rq`` of ``q`` and
    keys ``rk`` of the step's block ``blk`` (:func:`_blocks`), at their true positions."""
    k, v, kpos, kdoc = blk
    rq, rk = slice(pc.qs, pc.qe), slice(pc.ks, pc.ke)
    q, k, v = q[:, :, rq], k[:, :, rk], v[:, :, rk]
    qp, kp = ctx.a.q_positions[:, rq], kpos[:, rk]
    qd, kd = (None, None) if kdoc is None else (ctx.a.q_doc_ids[:, rq], kdoc[:, rk])
    a = check_inputs(q, k, v, ctx.pattern, scale=ctx.a.scale, q_positions=qp, k_positions=kp,
                     q_doc_ids=qd, k_doc_ids=kd, softcap=ctx.a.softcap or None)
    a = dataclasses.replace(a, skip_kv_heads=ctx.a.skip_kv_heads, head_base=ctx.a.head_base)
    backend = select_backend(q, a, ctx.backend)
    # The ``plan=`` argument of the piece's backend call: its kept kernel position plan
    # (``False``: the kernels cannot take these positions), made on the first call that goes to
    # the kernels; None while no call has (the backend is picked per call).
    if pc.kernel_plan is None:  # (None again where this call does not go to the kernels)
        pc.kernel_plan = backend.position_plan(
            check_inputs(q, k, v, ctx.pattern, q_positions=qp, k_positions=kp), ctx.pattern)
    plan = pc.kernel_plan  # with the piece's document ids ([B or 1, S] integer tensors), if any
    if plan and kd is not None:
        plan = dataclasses.replace(plan, qdoc=qd.to(torch.int32).contiguous(),
                                   kdoc=kd.to(torch.int32).contiguous())
    return backend, plan, (q, k, v, ctx.pattern, a, ctx.causal), rq, rk


def _run_part(bufs: dict, pieces: Pieces, pc: Piece, like, dtype):
    """The piece's rows of its query run's buffer in ``bufs`` (zeros, made at its first piece)."""
    lo, hi, _ = pieces.qruns[pc.run]
    if pc.run not in bufs:
        bufs[pc.run] = like.new_zeros(like.shape[:2] + (hi - lo, like.shape[-1]), dtype=dtype)
    return bufs[pc.run][:, :, pc.qs - lo:pc.qe - lo]


def _ring_forward(ctx: _Ctx, q, k, v):
    """Merged ``(out [B, Hq, Sq, Dv] in q.dtype, lse [B, Hq, Sq])``, lse in float32 (float64
    for float64 inputs). Rows no piece reaches keep ``out = 0, lse = -inf``."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    merged = {}  # query run -> its rows' out in acc (runs with several pieces; lse in place)
    for j, blk in _blocks(ctx, k, v):
        for pc in ctx.pieces.steps[j]:  # (an empty step, blk None, has no pieces)
            backend, plan, call, rq, _ = _piece_call(ctx, pc, q, blk)
            if ctx.pieces.writes[pc.run] == 1:  # the run's only piece: straight into the result
                backend.forward(*call, out=out[:, :, rq], lse=lse[:, :, rq], plan=plan)
                continue
            # several pieces: each merges into the run's result (in the kernels on their path)
            backend.accumulate(*call, _run_part(merged, ctx.pieces, pc, out, acc), lse[:, :, rq],
                               plan=plan)
    for run, o in merged.items():
        lo, hi, _ = ctx.pieces.qruns[run]
        out[:, :, lo:hi] = o.to(q.dtype)
    return out, lse


def _ring_backward(ctx: _Ctx, q, k, v, out, lse, dout, dlse):
    """``(dq, dk, dv)`` of the ring forward: each piece's gradient from the merged
    ``(out, lse)`` (the backend seam's ``backward``), summed."""
    acc = accum_dtype(q.dtype)
    dlse = None if dlse is None else dlse.to(acc)
    pieces = ctx.pieces
    dq = torch.zeros_like(q)
    dq_acc = {}  # run -> dq of its rows in acc (runs with several pieces)
    remote_grads = any(st.n_send for st in ctx.plan.steps)
    local = sorted((pc.ks, pc.ke) for pc in pieces.steps[0])  # (key ranges are never empty)
    # dK/dV straight in the input dtype when every key row gets at most one local piece and
    # nothing comes back from other ranks; else accumulators in acc
    direct_kv = not remote_grads and all(e <= s for (_, e), (s, _) in zip(local, local[1:]))
    kv_dtype = k.dtype if direct_kv else acc
    dk, dv = (torch.zeros(t.shape, dtype=kv_dtype, device=t.device) for t in (k, v))
    grads = GradExchange(dk, dv, ctx.plan, ctx.group(), acc)
    for j, blk in _blocks(ctx, k, v):
        gk_blk = gv_blk = None
        if j > 0 and blk is not None:  # the received block's gradient (0 for keys no piece reaches)
            gk_blk, gv_blk = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in blk[:2])
        for pc in pieces.steps[j]:  # (an empty step, blk None, has no pieces)
            # a run's only piece writes its dq rows in place; local keys whose only
            # gradient is this piece's likewise (sums None)
            direct_q = pieces.writes[pc.run] == 1
            backend, plan, (qb, kb, vb, *rule), rq, rk = _piece_call(ctx, pc, q, blk)
            # several pieces: each adds into the run's dq (in the kernels)
            into = None if direct_q else _run_part(dq_acc, pieces, pc, q, acc)
            # dK/dV: a received block's sums, local sums, or (direct) the result itself
            sums = (gk_blk, gv_blk) if j > 0 else None if direct_kv else (dk, dv)
            backend.backward(
                dout[:, :, rq], None if dlse is None else dlse[:, :, rq], qb, kb, vb,
                out[:, :, rq], lse[:, :, rq], *rule,
                grads=(dq[:, :, rq] if direct_q else None, dk[:, :, rk] if sums is None else None,
                       dv[:, :, rk] if sums is None else None), plan=plan, dq_acc=into,
                dkv_acc=None if sums is None else tuple(t[:, :, rk] for t in sums))
        if j > 0:
            # every rank posts step j's gradient exchange in the same step (order matters)
            grads.step(j, gk_blk, gv_blk)
    grads.finish()
    for run, g in dq_acc.items():
        lo, hi, _ = pieces.qruns[run]
        dq[:, :, lo:hi] = g.to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _shard_inputs(q, k, v, pattern, *, q_positions, k_positions, scale, q_doc_ids, k_doc_ids,
                  softcap, _skip_kv_heads=(), _head_base=0, **_) -> AttnInputs:
    """``check_inputs`` of a shard's call (the caller's keywords; others ignored), plus the
    ring's rules: positions required and >= 0, positions and document ids expanded to the batch
    (one convention on every rank); ``skip_kv_heads`` and ``head_base`` from the private ones."""
    for name, t in (("q_positions", q_positions), ("k_positions", k_positions)):
        if t is None:
            raise ValueError(f"ring_attention needs {name} (the true positions of this rank's "
                             "shard), got None")
    a = check_inputs(q, k, v, pattern, scale=scale, q_positions=q_positions,
                     k_positions=k_positions, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                     softcap=softcap)
    for name, t in (("q_positions", a.q_positions), ("k_positions", a.k_positions)):
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"{name} must be >= 0 (true positions), got min {int(t.min())}")

    given = {n: getattr(a, n) for n in ("q_positions", "k_positions", "q_doc_ids", "k_doc_ids")}
    return dataclasses.replace(a, skip_kv_heads=tuple(_skip_kv_heads), head_base=_head_base, **{
        n: None if t is None else t.expand(a.batch, -1).contiguous() for n, t in given.items()})


def local_attention(q, k, v, pattern, *, q_positions, k_positions, causal=True, scale=None,
                    q_doc_ids=None, k_doc_ids=None, return_lse=False, backend="auto",
                    softcap=None, _skip_kv_heads=()):
    """A shard's attention to its own keys only, as the ring computes its local step (per run
    of consecutive positions): :func:`~hf_hilbert_attn.dilated_attention` at the same positions,
    at a ring rank's cost without exchanges (``bench_ring.py``). Arguments and result as
    :func:`ring_attention` without ``group``."""
    kw = dict(q_positions=q_positions, k_positions=k_positions, causal=causal, scale=scale,
              q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, return_lse=return_lse, backend=backend,
              softcap=softcap)
    q, k, v = autocast_inputs(q, k, v)  # under torch.autocast: cast as SDPA does (then off)
    if pattern.dense_kv_heads:  # as the ring: a sparse and a dense call
        return with_dense_heads(local_attention, q, k, v, pattern, **kw)
    a = _shard_inputs(q, k, v, pattern, _skip_kv_heads=_skip_kv_heads, **kw)
    plan = RingPlan(0, 1, a.hkv)
    pieces = plan_pieces(pattern, causal, plan, a.q_positions, a.k_positions)
    ctx = _Ctx(pattern, causal, a, weak_group(None), plan, backend, pieces)
    with autocast_off(q):
        out, lse = _EagerKernels.apply(q, k, v, ctx)
    return (out, lse.float()) if return_lse else out


_PLANS = PlanCache()


def cached_plan(group) -> Optional[RingPlan]:
    """The send plan ring attention last made for ``group`` and keeps reusing while every rank's
    positions are unchanged, or None."""
    return getattr(_PLANS.get(group), "plan", None)


# Collectives, a plan cache and direct kernel launches: torch.compile runs it as one opaque
# call (a graph break) instead of tracing into the Triton launches.
@disable_lazily  # not torch.compiler.disable: that imports dynamo at import
def ring_attention(q, k, v, pattern, *, group, q_positions, k_positions, causal=True, scale=None,
                   q_doc_ids=None, k_doc_ids=None, return_lse=False, backend="auto",
                   softcap=None, _skip_kv_heads=(), _head_base=0):
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
        causal, scale, q_doc_ids, k_doc_ids, return_lse, backend, softcap: as in
            :func:`~hf_hilbert_attn.dilated_attention`, for this rank's tokens.

    Returns:
        ``out`` ``[B, Hq, Sq, D]`` (this rank's rows of the full attention), ``lse`` if asked.

    Raises:
        ValueError: bad shapes / positions, or (every rank) ranks disagreeing on the call.
    """
    kw = dict(q_positions=q_positions, k_positions=k_positions, causal=causal, scale=scale,
              q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, return_lse=return_lse, backend=backend,
              softcap=softcap, _head_base=_head_base)  # heads numbered from it (a Ulysses group's)
    if group is None or dist.get_world_size(group) == 1:
        return dilated_attention(q, k, v, pattern, _skip_kv_heads=_skip_kv_heads, **kw)
    q, k, v = autocast_inputs(q, k, v)  # under torch.autocast: cast as SDPA does (then off)
    if pattern.dense_kv_heads:  # a sparse ring over every head and a dense one over those heads
        return with_dense_heads(ring_attention, q, k, v, pattern, group=group, **kw)
    a = _shard_inputs(q, k, v, pattern, _skip_kv_heads=_skip_kv_heads, **kw)
    qp, kp, kd = a.q_positions, a.k_positions, a.k_doc_ids
    # the plan is reused while every rank still has its inputs (PlanCache; one flag in agree)
    key = (pattern, a.hq, a.hkv, bool(causal), q.device, a.skip_kv_heads, _head_base)
    entry = _PLANS.lookup(group, key, (qp, kp, kd))
    if not agree(q, k, v, pattern, causal, a.scale, qp, kp, kd, group,
                 cached=entry is not None):
        all_qp, all_kp, all_kd = (None if t is None else all_gather(t, group) for t in (qp, kp, kd))
        plan = plan_ring(pattern, a.hq, a.hkv, causal, dist.get_rank(group), all_qp, all_kp,
                         all_kd, a.skip_kv_heads, _head_base)
        entry = _PLANS.store(group, key, (qp, kp, kd), plan,
                             plan_pieces(pattern, causal, plan, qp, kp))
    # the autograd graph holds the group weakly (comm.weak_group)
    ctx = _Ctx(pattern, causal, a, weak_group(group), entry.plan, backend, entry.pieces)
    with autocast_off(q):
        out, lse = _EagerKernels.apply(q, k, v, ctx)
    return (out, lse.float()) if return_lse else out
