"""The blockwise engine: exactly what ``reference.reference_attention`` computes, block by block
in position space over the passes of ``passes.py``, never materialising ``[Sq, Sk]``, with a
FlashAttention-style backward. Any device, any positions and documents.
"""

from __future__ import annotations

import functools

import torch

from ..numerics import accum_dtype, finite_or_zero, merge_partials
from .passes import _OWN_RULE, _OWN_WINDOW, plan  # plan: the engine interface, with attend

def _block_mask(pattern, ps, qp, kp, qd, kd, chunk):
    """Mask ``[Bm, Hm, cq, ck]`` (Bm in {1, Bd}, Hm in {1, heads of the pass}) of the pairs of
    this block that pass ``ps`` owns, or ``None`` when every pair is owned."""
    _, _, need_causal, own, need_docs, dedupe, covered = chunk
    qc, kc = qp[:, None], kp[None, :]
    h = ps.head_ids.view(-1, 1, 1)
    parts = []  # the mask is their AND
    if own == _OWN_RULE:
        parts.append(pattern.config_allowed(ps.config, h, qc, kc))
    if own == _OWN_WINDOW or covered:
        # Sliding windows whose class test holds for every pair: the rule is a distance, with
        # no head dimension. Causal: the signed p - s, as pairs with s > p go anyway (below).
        dist = qc - kc if ps.causal else (qc - kc).abs()
        if own == _OWN_WINDOW:
            parts.append(dist < pattern.segment_lengths[ps.config])
        if covered:  # the union rule: |p - s| < covered belongs to an earlier config
            parts.append(dist >= covered)
    # the union rule: a pair belongs to the first config that allows it
    parts += [~pattern.config_allowed(j, h, qc, kc) for j in dedupe]
    if need_causal and not (covered and ps.causal):  # p - s >= covered > 0 is causal already
        parts.append(kc <= qc)
    if need_docs:  # same document only; a negative key id is padding
        parts.append(((qd[:, :, None] == kd[:, None, :]) & (kd[:, None, :] >= 0))[:, None])
    if not parts:
        return None
    mask = functools.reduce(torch.logical_and, parts)
    return mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _pass_views(ps, hkv):
    """Per-pass head layout ``(hk, g)``: scores are ``[B, hk, g * cq, ck]``. All heads: the
    grouped view (hk = Hkv, g = Hq // Hkv); a subset of heads: one row block per head."""
    return (hkv, ps.head_ids.numel() // hkv) if ps.kv_ids is None else (ps.head_ids.numel(), 1)


def _key_chunk(ps, kf, vf, chunk):
    """Storage rows ``ki`` of a key chunk and its K and V blocks ``[B', hk, ck, D]``
    (``t[rows][:, kv heads][:, :, ki]``: only the block is copied)."""
    ki = ps.k_order[chunk[0]:chunk[1]]
    blocks = (t[ps.rows].index_select(2, ki) for t in (kf, vf))
    return (ki, *(b if ps.kv_ids is None else b.index_select(1, ps.kv_ids) for b in blocks))


def _query_tile(ps, lo, hi, hk, g, *srcs):
    """Storage rows ``qi`` of the query tile ``lo:hi``, its positions and document ids, and the
    tile's rows of each source ``[B', Hc, Sq, D]`` as ``[B', hk, g * cq, D]``."""
    qi = ps.q_order[lo:hi]
    qd = None if ps.q_doc is None else ps.q_doc[:, lo:hi]
    rows = (x.index_select(2, qi).reshape(x.shape[0], hk, g * len(qi), -1) for x in srcs)
    return (qi, ps.q_pos[lo:hi], qd, *rows)


def _mask_scores(s, pattern, ps, chunk, qp, qd, hk, g):
    """Scores ``s`` ``[B', hk, g*cq, ck]`` with the pairs the pattern forbids set to -inf
    (unchanged when the whole block is allowed)."""
    k_lo, k_hi = chunk[0], chunk[1]
    kd = None if ps.k_doc is None else ps.k_doc[:, k_lo:k_hi]
    mask = _block_mask(pattern, ps, qp, ps.k_pos[k_lo:k_hi], qd, kd, chunk)
    if mask is None:
        return s
    # the mask [Bm, Hm, cq, ck], broadcastable to the scores viewed as [B, hk, g, cq, ck]
    mask = mask[:, :, None] if mask.shape[1] == 1 else mask.unflatten(1, (hk, g))
    s5 = s.view(s.shape[0], hk, g, -1, s.shape[-1])
    return torch.where(mask, s5, float("-inf")).view_as(s)


def _scores(qb, kb, softcap):
    """A block's scores ``[B', hk, g*cq, ck]`` from scaled queries, and (soft-capped:
    ``softcap * tanh(s / softcap)``) the factor ``1 - tanh**2`` their gradient takes, else 1."""
    s = torch.matmul(qb, kb.transpose(-1, -2))
    if not softcap:
        return s, 1.0
    t = torch.tanh(s.div_(softcap))
    return t * softcap, 1.0 - t * t


def _chunked_forward(pattern, passes, qf, kf, vf, softcap):
    """Forward over the plan: ``out [B, Hq, Sq, Dv]`` and ``lse [B, Hq, Sq]`` in qf's dtype.
    ``qf`` is already multiplied by the softmax scale."""
    dv = vf.shape[-1]
    out = qf.new_zeros(*qf.shape[:3], dv)
    lse = qf.new_full(qf.shape[:3], float("-inf"))
    for ps in passes:
        hk, g = _pass_views(ps, kf.shape[1])
        q_src = qf[ps.rows, ps.heads]
        out_v, lse_v = out[ps.rows, ps.heads], lse[ps.rows, ps.heads]
        for lo, hi, chunks in ps.tiles:
            qi, qp, qd, qb = _query_tile(ps, lo, hi, hk, g, q_src)
            nb, cq = qb.shape[0], qi.numel()
            m = qb.new_full((nb, hk, g * cq), float("-inf"))
            l = qb.new_zeros(nb, hk, g * cq)
            acc = qb.new_zeros(nb, hk, g * cq, dv)
            for chunk in chunks:
                ki, kb, vb = _key_chunk(ps, kf, vf, chunk)
                s = _scores(qb, kb, softcap)[0]  # [B', hk, g*cq, ck]
                s = _mask_scores(s, pattern, ps, chunk, qp, qd, hk, g)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = finite_or_zero(m_new)  # empty rows stay 0
                p = s.sub_(m_safe[..., None]).exp_()
                corr = torch.exp(m - m_safe)
                # A ones column on V makes the row sums of p come out of the same matmul.
                pv = torch.matmul(p, torch.cat([vb, vb.new_ones(vb.shape[:-1] + (1,))], -1))
                l = l * corr + pv[..., -1]
                acc = acc * corr[..., None] + pv[..., :-1]
                m = m_new
            # Tile result (lse_t, out_t), merged into the running (lse, out) of these queries.
            lse_t = (m + torch.log(l)).view(nb, hk * g, cq)  # -inf where nothing was allowed
            out_t = (acc / l.clamp_min(torch.finfo(l.dtype).tiny)[..., None]).view(nb, hk * g, cq, dv)
            o, new = merge_partials(out_v.index_select(2, qi), lse_v.index_select(2, qi), out_t,
                                    lse_t)
            lse_v.index_copy_(2, qi, new)
            out_v.index_copy_(2, qi, o)
    return out, lse


def _chunked_backward(pattern, passes, qf, kf, vf, dout, lse, delta, scale, softcap):
    """FlashAttention-style backward: probabilities recomputed block by block from ``lse``;
    ``delta = rowsum(dO * O) - dlse``. ``qf`` is scaled. Returns dq, dk, dv (qf's dtype)."""
    dq, dk, dv = (torch.zeros_like(x) for x in (qf, kf, vf))
    hkv = kf.shape[1]
    lse_safe = finite_or_zero(lse)  # rows with no key: p = 0 anyway
    for ps in passes:
        hk, g = _pass_views(ps, hkv)
        q_src, do_src = qf[ps.rows, ps.heads], dout[ps.rows, ps.heads]
        lse_src, delta_src = lse_safe[ps.rows, ps.heads, :, None], delta[ps.rows, ps.heads, :, None]
        dq_v, dk_v, dv_v = dq[ps.rows, ps.heads], dk[ps.rows], dv[ps.rows]
        for lo, hi, chunks in ps.tiles:
            qi, qp, qd, qb, dob, lse_b, delta_b = _query_tile(ps, lo, hi, hk, g, q_src, do_src,
                                                              lse_src, delta_src)
            nb, cq = qb.shape[0], qi.numel()
            dq_t = torch.zeros_like(qb)
            for chunk in chunks:
                ki, kb, vb = _key_chunk(ps, kf, vf, chunk)
                s, dcap = _scores(qb, kb, softcap)
                s = _mask_scores(s.sub_(lse_b), pattern, ps, chunk, qp, qd, hk, g)
                p = s.exp_()  # [B', hk, g*cq, ck]
                dv_b = torch.matmul(p.transpose(-1, -2), dob)  # [B', hk, ck, Dv]
                ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta_b).mul_(p)
                ds = ds.mul_(dcap) if softcap else ds
                dq_t += torch.matmul(ds, kb)
                dk_b = torch.matmul(ds.transpose(-1, -2), qb)  # q is scaled: d(s)/dk = scale*q
                for grad, x in ((dk_v, dk_b), (dv_v, dv_b)):
                    if ps.kv_ids is not None:  # fold the pass's heads onto their key/value heads
                        x = x.new_zeros(nb, hkv, *x.shape[2:]).index_add_(1, ps.kv_ids, x)
                    grad.index_add_(2, ki, x)
            dq_v.index_add_(2, qi, dq_t.view(nb, hk * g, cq, -1))
    return dq * scale, dk, dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pattern, passes, scale, softcap):
        cdt = accum_dtype(q.dtype)
        qf = q.to(cdt) * scale
        out, lse = _chunked_forward(pattern, passes, qf, k.to(cdt), v.to(cdt), softcap)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern, ctx.passes, ctx.scale, ctx.softcap = pattern, passes, scale, softcap
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # computes in its own dtype even when backward() runs inside torch.autocast
        with torch.autocast(dout.device.type, enabled=False):
            cdt = lse.dtype
            dout = dout.to(cdt)
            delta = (dout * out.to(cdt)).sum(-1)  # [B, Hq, Sq]
            if dlse is not None:
                delta = delta - dlse.to(cdt)  # d lse / d s = p: folds into the same ds formula
            dq, dk, dv = _chunked_backward(ctx.pattern, ctx.passes, q.to(cdt) * ctx.scale,
                                           k.to(cdt), v.to(cdt), dout, lse, delta, ctx.scale,
                                           ctx.softcap)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def attend(q, k, v, pattern, a, passes):
    return _ChunkedAttention.apply(q, k, v, pattern, passes, a.scale, a.softcap)
