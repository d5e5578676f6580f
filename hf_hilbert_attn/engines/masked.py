"""The few-queries engine: a handful of queries against many keys (decoding) as one call of
the fused CPU kernel with the pattern's mask."""

from __future__ import annotations

import torch

from ..numerics import accum_dtype, finite_or_zero
from ..plan_cache import PlanCache
from .tiles import _FLASH_FWD

# --------------------------------------------------------------------------------------------
# Few queries against many keys (decoding): one call of the fused CPU kernel over every key,
# with the pattern's boolean mask (``DilatedPattern.build_mask``) as an additive float mask,
# made once per (pattern, positions, document ids) and reused by the layers of a step
# (``plan_cache``). It reads every key, where the blockwise path reads about
# sum_i min(w_i, Sk) / r_i per query but plans more per step: taken while Sk is at most
# FEW_QUERIES_KEY_RATIO times that sum (measured: docs/decisions.md D35). The backward
# recomputes the probabilities from lse in plain matmuls (as small as the mask).
# --------------------------------------------------------------------------------------------

FEW_QUERIES_MAX = 16  # queries per call (decode, speculative decode); more: the blockwise plan
FEW_QUERIES_KEY_RATIO = 2.0
FEW_QUERIES_MAX_ELEMENTS = 1 << 23  # B * Hq * Sq * Sk: the float mask's size
_MASK_CACHE = PlanCache(4, per_key=1)  # a step's mask; at most 4 (each <= 32 MB)


class _MaskPlan:
    """``mask`` ``[Bm, Hq, Sq, Sk]`` additive (0 / -inf) in the compute dtype (Bm in {1, B});
    ``empty`` ``[Bm, Hq, Sq]`` the queries with no allowed key, or None."""

    __slots__ = ("mask", "empty")


def _few_queries_apply(pattern, a, q) -> bool:
    """Whether the fused masked call takes this call (see the comment above)."""
    if not (_FLASH_FWD is not None and q.device.type == "cpu" and a.sq <= FEW_QUERIES_MAX
            and a.head_dim_v == a.head_dim
            and a.batch * a.hq * a.sq * a.sk <= FEW_QUERIES_MAX_ELEMENTS):
        return False
    read = sum(min(w, a.sk) // r for w, r in pattern.configs) + pattern.sink_tokens
    return a.sk <= FEW_QUERIES_KEY_RATIO * read


def _few_queries_plan(pattern, a, causal, dtype) -> _MaskPlan:
    """The additive mask of this call (cached: every layer of a step asks for the same)."""
    cdt = accum_dtype(dtype)

    def make():
        allowed = pattern.build_mask(a.hq, a.q_positions, a.k_positions, causal=causal,
                                     q_doc_ids=a.q_doc_ids, k_doc_ids=a.k_doc_ids,
                                     num_kv_heads=a.hkv)
        plan = _MaskPlan()
        plan.mask = torch.zeros(allowed.shape, dtype=cdt, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))
        empty = ~allowed.any(-1)
        plan.empty = empty if bool(empty.any()) else None
        return plan

    key = ("mask", pattern, bool(causal), a.batch, a.hq, a.hkv, a.sq, a.sk, cdt)
    return _MASK_CACHE.get_or_make(key, (a.q_positions, a.k_positions, a.q_doc_ids,
                                         a.k_doc_ids), make)


def _few_queries_forward(q, k, v, plan, scale):
    """``(out, lse)`` of the fused masked call, both in the accumulation dtype."""
    cdt = accum_dtype(q.dtype)
    out, lse = _FLASH_FWD(q.to(cdt), k.to(cdt), v.to(cdt), 0.0, False, attn_mask=plan.mask,
                          scale=scale)
    out, lse = out.to(cdt), lse.to(cdt)
    if plan.empty is not None:  # the kernel gives lse 0 (and out 0) to a row with no key
        lse = lse.masked_fill(plan.empty, float("-inf"))
    return out, lse


def _few_queries(q, k, v, plan, scale):
    """``(out in q.dtype, lse)``; without a gradient to record (decoding), no autograd
    Function around it (its bookkeeping is a tenth of a short call)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FewQueriesAttention.apply(q, k, v, plan, scale)
    out, lse = _few_queries_forward(q, k, v, plan, scale)
    return out.to(q.dtype), lse


class _FewQueriesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        ctx.set_materialize_grads(False)
        out, lse = _few_queries_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None
        with torch.autocast(q.device.type, enabled=False):
            cdt = lse.dtype
            b, hq, sq, d = q.shape
            hkv, sk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
            rows = (hq // hkv) * sq  # grouped view: query head h = kv head * G + g
            qg, kc, vc = q.to(cdt).reshape(b, hkv, rows, d), k.to(cdt), v.to(cdt)
            mask = ctx.plan.mask.reshape(-1, hkv, rows, sk)
            s = torch.matmul(qg, kc.transpose(-1, -2)).mul_(ctx.scale).add_(mask)
            p = s.sub_(finite_or_zero(lse).reshape(b, hkv, rows, 1)).exp_()  # 0: masked, empty
            do = (torch.zeros_like(out) if dout is None else dout.to(cdt)).reshape(
                b, hkv, rows, dv_)
            delta = (do * out.reshape(b, hkv, rows, dv_)).sum(-1, keepdim=True)
            if dlse is not None:
                delta = delta - dlse.to(cdt).reshape(b, hkv, rows, 1)
            dv = torch.matmul(p.transpose(-1, -2), do)
            ds = torch.matmul(do, vc.transpose(-1, -2)).sub_(delta).mul_(p)
            dq = torch.matmul(ds, kc).mul_(ctx.scale).reshape(b, hq, sq, d)
            dk = torch.matmul(ds.transpose(-1, -2), qg).mul_(ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def plan(pattern, a, causal, q):
    """The engine interface (``chunked.ENGINES``): the mask plan, or None (too many queries or
    keys for one masked call)."""
    if not _few_queries_apply(pattern, a, q):
        return None
    return _few_queries_plan(pattern, a, causal, q.dtype)


def attend(q, k, v, pattern, a, plan):
    return _few_queries(q, k, v, plan, a.scale)
