"""Head-sharded (Ulysses) sequence parallelism, and the choice between it and the ring.

Every rank holds a shard of the sequence (q, k, v of some tokens with their true positions, any
layout). One all-to-all per tensor turns the shards into head groups: rank ``r`` receives every
token of query heads ``[r·n, (r+1)·n)`` (``n = Hq / W``) and of the key/value heads they read
(a key/value head goes to every rank that needs it when there are fewer than ranks). Each rank
then runs the one-process op on its heads, numbered from ``r·n`` in the pattern's rule
(per_head classes ``h mod r_i`` and dense key/value heads are those of one process), and one
more all-to-all brings every head of its own tokens back. The backward runs the exchanges in
reverse (an all-to-all of equal chunks is its own adjoint) around the op's own backward.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ..compiler import disable_lazily
from ..numerics import autocast_inputs
from ..ops import dilated_attention
from .attention import _shard_inputs, ring_attention
from .comm import agree, all_gather, split_group, weak_group
from .plan import PlanCache

__all__ = ["ulysses_attention", "sequence_parallel_attention", "resolve_mode", "ulysses_size"]


def heads_split(hq: int, hkv: int, world: int) -> bool:
    """Whether ``hq`` query and ``hkv`` key/value heads shard over ``world`` ranks: ``world``
    divides ``hq``, and divides ``hkv`` or is a multiple of it."""
    return not (hq % world or (hkv % world and world % hkv))


class _AllToAll(torch.autograd.Function):
    """Chunk ``j`` of dim 0 to rank ``j``, chunk ``j`` of the result from rank ``j``; the backward
    is the same exchange of the gradient (the group held weakly, as the ring's: comm.weak_group)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = weak_group(group)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.forward(ctx, grad.contiguous(), ctx.group()), None


def _to_heads(x: torch.Tensor, group, world: int, order) -> torch.Tensor:
    """``[B, H, L, D]`` (this rank's ``L`` tokens, every head) -> ``[B, H / W, W·L, D]`` (this
    rank's heads, every token, shards in rank order, then in ``order`` unless None): a view of
    a token-major ``[B, W·L, H / W, D]`` tensor, received in place for ``B = 1`` (one copy, the
    send buffer's; ``order``: one more)."""
    b, h, length, d = x.shape
    send = x.transpose(1, 2).reshape(b, length, world, h // world, d).permute(2, 0, 1, 3, 4)
    recv = _AllToAll.apply(send.contiguous(), group)  # [W, B, L, n, D]: rank j's tokens
    recv = recv.transpose(0, 1).reshape(b, world * length, h // world, d)  # (B = 1: a view)
    return (recv if order is None else recv.index_select(1, order)).transpose(1, 2)


def _to_tokens(y: torch.Tensor, group, world: int, inverse) -> torch.Tensor:
    """Inverse of :func:`_to_heads`: ``[B, n, W·L, D]`` (tokens put back by ``inverse`` unless
    None) -> ``[B, W·n, L, D]``, a view of a contiguous ``[B, L, W·n, D]`` tensor (the layout a
    model's output projection reads)."""
    b, n, s, d = y.shape
    y = y if inverse is None else y.index_select(2, inverse)
    send = y.transpose(1, 2).reshape(b, world, s // world, n, d).transpose(0, 1)
    recv = _AllToAll.apply(send.contiguous(), group)  # [W, B, L, n, D]: rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * n, d).transpose(1, 2)


# Every layer of a forward gives the same positions: the first layer's gather serves the others
# (kept per group while every rank's inputs are unchanged, as the ring's plans)
_GATHERED = PlanCache()


def _gather(group, inputs: tuple) -> tuple:
    """Every rank's ``inputs`` (q, k positions, q, k document ids: ``[B, L]`` each, or None)
    concatenated in rank order, then ``(order, inverse)``: where the positions are one
    permutation of distinct positions for every row and not in order (zigzag, Hilbert shards),
    the tokens are attended sorted by position (``order``: the kernels' fast path; measured,
    docs/decisions.md D61), else None."""
    qp, kp, qd, kd = (None if t is None else torch.cat(all_gather(t, group), 1) for t in inputs)
    order = inverse = None
    if qd is None and torch.equal(qp, kp) and bool((qp == qp[:1]).all()):
        order = torch.argsort(qp[0])
        if bool((order[1:] > order[:-1]).all()):
            order = None  # already in order
        else:
            inverse = torch.argsort(order)
            qp = kp = qp.index_select(1, order)
    return qp, kp, qd, kd, order, inverse


def head_slice(rank: int, world: int, hq: int, hkv: int) -> tuple:
    """``(first query head, first key/value head, key/value heads)`` rank ``rank`` of ``world``
    attends when heads are sharded: consecutive query heads, and the key/value heads they read
    (fewer key/value heads than ranks: each replicated to the ranks that read it; DeepSpeed's
    Ulysses numbers them alike)."""
    nkv = max(1, hkv // world)
    return rank * (hq // world), rank * nkv // max(1, world // hkv), nkv


@functools.lru_cache(maxsize=64)
def _local_pattern(pattern, kv0: int, nkv: int):
    """``pattern`` on a rank holding key/value heads ``[kv0, kv0 + nkv)``: its dense heads in
    local indices."""
    return pattern if not pattern.dense_kv_heads else pattern.replace(
        dense_kv_heads=[j - kv0 for j in pattern.dense_kv_heads if kv0 <= j < kv0 + nkv])


@disable_lazily  # collectives and host-side checks: one opaque call under torch.compile
def ulysses_attention(q, k, v, pattern, *, group, q_positions, k_positions, causal=True,
                      scale=None, q_doc_ids=None, k_doc_ids=None, return_lse=False,
                      backend="auto", softcap=None, _ring=None):
    """Dilated attention over a sequence sharded across ``group``, by heads (module docstring).

    Arguments and result as :func:`~hf_hilbert_attn.ring_attention`; queries and keys are the
    same tokens' (``Sq == Sk`` on every rank). ``ValueError``: heads that do not split over the
    group (:func:`heads_split`), or ranks that disagree on the call. ``_ring`` (private, mode
    ``"hybrid"``): the group across which the gathered sequences form a ring (None: one)."""
    kw = dict(q_positions=q_positions, k_positions=k_positions, causal=causal, scale=scale,
              q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, return_lse=return_lse, backend=backend,
              softcap=softcap)
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return dilated_attention(q, k, v, pattern, **kw)
    q, k, v = autocast_inputs(q, k, v)  # under torch.autocast: cast as SDPA does (the attention
    # of the gathered heads computes with it off)
    a = _shard_inputs(q, k, v, pattern, **kw)
    if a.sq != a.sk:
        raise ValueError(f"mode='ulysses' needs queries and keys of the same tokens, got "
                         f"{a.sq} queries and {a.sk} keys on this rank; use mode='ring'")
    if not heads_split(a.hq, a.hkv, world):
        raise ValueError(
            f"mode='ulysses' shards heads: {a.hq} query and {a.hkv} key/value heads do not split "
            f"over {world} ranks (the ranks must divide the query heads, and divide or be a "
            "multiple of the key/value heads); use mode='ring'")
    inputs = (a.q_positions, a.k_positions, a.q_doc_ids, a.k_doc_ids)
    entry = _GATHERED.lookup(group, ("ulysses",), inputs)
    if not agree(q, k, v, pattern, causal, a.scale, a.q_positions, a.k_positions, a.k_doc_ids,
                 group, cached=entry is not None):
        entry = _GATHERED.store(group, ("ulysses",), inputs, _gather(group, inputs), None)
    qp, kp, qd, kd, order, inverse = entry.plan
    rep = max(1, world // a.hkv)
    if rep > 1:  # fewer key/value heads than ranks: each goes to the ranks whose queries read it
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    hbase, kv0, nkv = head_slice(dist.get_rank(group), world, a.hq, a.hkv)
    q, k, v = (_to_heads(t, group, world, order) for t in (q, k, v))
    attend = dilated_attention if _ring is None else functools.partial(ring_attention, group=_ring)
    out = attend(q, k, v, _local_pattern(pattern, kv0, nkv), causal=causal, scale=a.scale,
                 q_positions=qp, k_positions=kp, q_doc_ids=qd, k_doc_ids=kd,
                 return_lse=return_lse, backend=backend, softcap=softcap, _head_base=hbase)
    if not return_lse:
        return _to_tokens(out, group, world, inverse)
    return (_to_tokens(out[0], group, world, inverse),
            _to_tokens(out[1].unsqueeze(-1), group, world, inverse).squeeze(-1))


def resolve_mode(mode: str, world: int, hq: int, hkv: int, pattern) -> str:
    """The mode ``"auto"`` stands for on ``world`` ranks (others unchanged): ``"ulysses"`` where
    the heads split over the ranks (:func:`heads_split`) and every rank gets as many dense
    key/value heads (a dense head costs a causal attention over the whole sequence: a rank with
    more waits for nobody), else ``"ring"`` (measured: docs/decisions.md D60)."""
    if mode != "auto":
        return mode
    if not heads_split(hq, hkv, world):
        return "ring"
    dense = [sum(kv0 <= j < kv0 + nkv for j in pattern.dense_kv_heads)  # (head_slice's heads)
             for _, kv0, nkv in (head_slice(r, world, hq, hkv) for r in range(world))]
    return "ulysses" if min(dense) == max(dense) else "ring"


def ulysses_size(world: int, hq: int, hkv: int) -> int:
    """Mode ``"hybrid"``'s Ulysses group size: the largest divisor of ``world`` over which the
    heads split (:func:`heads_split`) that holds no more ranks than one node
    (``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it; else ``world``); 1: a ring alone."""
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(u for u in range(1, min(world, node) + 1)
               if world % u == 0 and heads_split(hq, hkv, u))


def sequence_parallel_attention(q, k, v, pattern, *, group, mode: str = "auto", **kwargs):
    """:func:`~hf_hilbert_attn.ring_attention`, :func:`ulysses_attention` or both (``mode``:
    ``"hybrid"``: Ulysses within groups of :func:`ulysses_size` ranks, a ring across them;
    ``"auto"``: :func:`resolve_mode`), with their arguments."""
    world = 1 if group is None else dist.get_world_size(group)  # (1: the op itself)
    mode = resolve_mode(mode, world, q.shape[1], k.shape[1], pattern)
    u = ulysses_size(world, q.shape[1], k.shape[1]) if mode == "hybrid" else 0
    if 1 < u < world:  # this rank's Ulysses group (u consecutive ranks), ring across them
        inner, ring = split_group(group, u)
        return ulysses_attention(q, k, v, pattern, group=inner, _ring=ring, **kwargs)
    return (ulysses_attention if mode == "ulysses" or u == world else ring_attention)(
        q, k, v, pattern, group=group, **kwargs)
