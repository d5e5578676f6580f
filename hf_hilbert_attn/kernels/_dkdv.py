"""The backward's dk/dv kernel: a program per key tile of one key/value head, over its group's
query heads (``_bwd.py``: the design, the arguments, the dq kernel and the launch of both)."""

import triton
import triton.language as tl

from ._common import (LOG2E, _SCALARS, _band_tail, _dot, _kv_program, _launch_order,
                      _launch_scalars, _launch_sinks, _logits2, _n_range, _participates, _row_ptrs,
                      _split_at, _union_keep, _union_prologue, _union_tab)


@triton.jit
def _dkdv_tiles(dk, dv, cols, qside, uni, lo, hi, end,
                BM: tl.constexpr, D: tl.constexpr, EDGE: tl.constexpr, UNION: tl.constexpr,
                UTAB: tl.constexpr, F: tl.constexpr):
    """dk, dv over query tiles ``lo, lo+BM, .. < hi`` (queries ``n < end``), transposed tiles
    (rows = keys). Queries past ``end`` load as zeros (q, dO, lse, delta) and add nothing.
    ``cols``: the program's keys ``(k, v, kd, offs_n, pk, p0, p1, sbase, R, h, b64,
    scales, LB, LC)``; ``qside``: where queries live ``(q_base, do_base, QINV, QDOC, LSE, DELTA,
    lrow, sqinv, sqdoc, sqs, sds, QOFF)`` (bases and ``lrow``, the offset of lse's and delta's
    rows, at the program's batch and query head); ``uni`` as in ``_fwd._fwd_tiles``."""
    k, v, kd, offs_n, pk, p0, p1, sbase, R, h, b64, scales, LB, LC = cols
    q_base, do_base, QINV, QDOC, LSE, DELTA, lrow, sqinv, sqdoc, sqs, sds, QOFF = qside
    CFG, NPRI, KEYS, PSZ, kp0, kp1, kp2, kp3 = uni
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        pq = sbase + R * offs_m
        row_ok = offs_m < end
        if F.MAPPED:
            qidx = tl.load(QINV + b64 * sqinv + pq, mask=row_ok, other=-1)
            row_ok = row_ok & (qidx >= 0)
            qidx = tl.where(row_ok, qidx, 0)
        else:
            qidx = tl.where(row_ok, pq - QOFF, 0)
        q64 = qidx.to(tl.int64)
        q = tl.load(q_base + q64[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + q64[:, None] * sds + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(LSE + lrow + q64, mask=row_ok, other=0.0) * LOG2E
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(DELTA + lrow + q64, mask=row_ok, other=0.0)
        st = _dot(k, tl.trans(q), None, F.IEEE)
        dpt = _dot(v, tl.trans(do), None, F.IEEE)
        xt, dcap = _logits2(st, scales, F.SOFTCAP)
        pt = tl.math.exp2(xt - lse2[None, :])
        if (F.CAUSAL and EDGE) or (F.SLIDING and EDGE) or F.MAPPED == 2 or F.HAS_DOC or UNION:
            keep = row_ok[None, :] & (offs_n[:, None] >= 0)  # [BN, BM]
            if F.CAUSAL and EDGE:  # (moved by the LC class steps earlier configs own)
                keep = keep & (offs_n[:, None] + LC <= offs_m[None, :])
            if F.SLIDING and EDGE:  # the window: n_q <= n_k + LB (>= n_k - LB non-causal)
                keep = keep & (offs_m[None, :] <= offs_n[:, None] + LB)
                if not F.CAUSAL:
                    keep = keep & (offs_m[None, :] >= offs_n[:, None] - LB)
            if UNION:
                if UTAB > 0:
                    keep = keep & _union_tab(kp0, kp1, kp2, kp3, KEYS, PSZ, pq, UTAB=UTAB)
                else:
                    keep = keep & _union_keep(pq[None, :], pk[:, None], p0, p1, R, h, CFG, NPRI,
                                              PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING,
                                              SINK=False)
            if F.HAS_DOC:
                qd = tl.load(QDOC + b64 * sqdoc + qidx, mask=row_ok, other=-2)
                keep = keep & (qd[None, :] == kd[:, None]) & (kd[:, None] >= 0)
            pt = tl.where(keep, pt, 0.0)
        dst = pt * (dpt - delta[None, :])
        if F.SOFTCAP:
            dst = dst * dcap
        dv = _dot(pt.to(do.dtype), do, dv, F.IEEE)
        dk = _dot(dst.to(q.dtype), q, dk, F.IEEE)
    return dk, dv


@triton.jit
def _dkdv_span(dk, dv, cols, qside, uni, lo, mid, tail, end, ma, mb, BM: tl.constexpr,
               D: tl.constexpr, UNION: tl.constexpr, UTAB: tl.constexpr, F: tl.constexpr):
    """dk, dv over query tiles ``[lo, mid)`` masked (the diagonal), then ``[mid, tail)`` whole,
    then (sliding) ``[tail, end)`` masked: queries past some key's window.
    ``UNION``: with the per-pair union mask on the masked tiles and on the whole tiles that
    meet ``[ma, mb)`` only."""
    dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, lo, mid, end, BM=BM, D=D, EDGE=True,
                         UNION=UNION, UTAB=UTAB, F=F)
    if UNION:
        x1, x2 = _split_at(mid, tail, ma, mb, BN=BM)
        dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, mid, x1, end, BM=BM, D=D, EDGE=False,
                             UNION=False, UTAB=UTAB, F=F)
        dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, x1, x2, end, BM=BM, D=D, EDGE=False,
                             UNION=True, UTAB=UTAB, F=F)
        dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, x2, tail, end, BM=BM, D=D, EDGE=False,
                             UNION=False, UTAB=UTAB, F=F)
    else:
        dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, mid, tail, end, BM=BM, D=D, EDGE=False,
                             UNION=UNION, UTAB=UTAB, F=F)
    if F.SLIDING:
        dk, dv = _dkdv_tiles(dk, dv, cols, qside, uni, tail, end, end, BM=BM, D=D, EDGE=True,
                             UNION=UNION, UTAB=UTAB, F=F)
    return dk, dv


@triton.jit
def _dkdv_union(dk, dv, cols, qside, col_ok, qn_lo, qn_hi, full_lo, band_hi, CFG, NPRI, KEYS,
                PSZ, BM: tl.constexpr, D: tl.constexpr, UTAB: tl.constexpr, F: tl.constexpr):
    """dk, dv of one query head over the query tiles of a config with earlier configs: queries
    ``[ca, cb)`` covered by them for the whole key tile are skipped; each remaining range starts
    with the diagonal tiles (masked), then whole unmasked tiles (sliding: then the masked tiles
    past the window); with ``F.MIXED`` the union mask on the diagonal tiles and on the whole tiles
    in ``[ma, mb)`` (as ``_fwd._fwd_union``)."""
    k, v, kd, offs_n, pk, pk0, pk1, sbase, R, h, b64, scales, LB, LC = cols
    ca, cb, ma, mb, uni = _union_prologue(pk, col_ok, pk0, pk1, sbase, R, h, qn_hi, CFG, NPRI,
                                          KEYS, PSZ, UTAB=UTAB, F=F, KSIDE=True)
    a_hi = tl.minimum(ca, qn_hi)
    b_lo = tl.maximum(cb, qn_lo)
    a_mid = tl.minimum(qn_lo + tl.maximum(full_lo - qn_lo + BM - 1, 0) // BM * BM, a_hi)
    b_mid = tl.minimum(b_lo + tl.maximum(full_lo - b_lo + BM - 1, 0) // BM * BM, qn_hi)
    a_tail = _band_tail(a_mid, a_hi, band_hi, BM=BM)
    b_tail = _band_tail(b_mid, qn_hi, band_hi, BM=BM)
    # Both query ranges through one copy of the tile loops (a program that needs no per-pair
    # mask has an empty [ma, mb): with F.MIXED only its diagonal tiles test the union rule). Against
    # four copies: 104 instead of 680 bytes of spills per thread on sm_90, half the compile
    # time, the same speed (docs/decisions.md "dk/dv: one copy of the tile loops"). Sliding
    # and causal, the covered queries start at 0 (``_covered``): the upper range only.
    for part in range(1 if F.SLIDING and F.CAUSAL else 0, 2):
        lo = tl.where(part == 0, qn_lo, b_lo)
        mid = tl.where(part == 0, a_mid, b_mid)
        tail = tl.where(part == 0, a_tail, b_tail)
        hi = tl.where(part == 0, a_hi, qn_hi)
        dk, dv = _dkdv_span(dk, dv, cols, qside, uni, lo, mid, tail, hi, ma, mb, BM=BM, D=D,
                            UNION=F.MIXED, UTAB=UTAB, F=F)
    return dk, dv


@triton.jit(do_not_specialize=_SCALARS)
def _dkdv_kernel(q, k, v, do, lse, delta, dk, dv, dkacc, dvacc, sinkg, pos, tables, L, R, LB, LC,
                 NPRI, PSZ, GROUP, QOFF, scales, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 F: tl.constexpr):
    """dk and dv of one config's launch; arguments as in ``_dq_kernel`` (heads: key/value heads;
    ``dkacc`` / ``dvacc``: the float32 sums of earlier launches, a chunk of key/value heads)."""
    # Grid: (segments * NCLS classes * key blocks, B * Hkv): every class, or (per_head) the
    # min(R, GROUP) its group's query heads read; other rows are not touched (nothing to add).
    CFG, LCFG, KEYS = tables
    HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
    b, hkl, hk, blk, sbase, ncl, c = _kv_program(HOFF, HCH, HBASE, SEG0, NCLS, NBLK, BLK0, W, R,
                                                 GROUP, F.PER_HEAD)
    b64 = b.to(tl.int64)

    kn_lo, kn_hi = _n_range(sbase, ncl, KLO, KHI, R)
    offs_n = blk * BN + tl.arange(0, BN)
    pk = sbase + R * offs_n
    col_ok = (offs_n >= kn_lo) & (offs_n < kn_hi)
    if F.MAPPED:
        kidx = tl.load(pos.KINV + b64 * pos.skinv + pk, mask=col_ok, other=-1)
        col_ok = col_ok & (kidx >= 0)
    else:
        kidx = pk - KOFF
    kidx = tl.where(col_ok, kidx, 0)
    kt = tl.load(_row_ptrs(k, b64, hk, kidx, D=D), mask=col_ok[:, None], other=0.0)
    vt = tl.load(_row_ptrs(v, b64, hk, kidx, D=D), mask=col_ok[:, None], other=0.0)
    kd = tl.load(pos.KDOC + b64 * pos.skdoc + kidx, mask=col_ok, other=-1) if F.HAS_DOC \
        else kidx

    n_first = tl.maximum(blk * BN, kn_lo)
    n_last = tl.minimum(blk * BN + BN, kn_hi) - 1
    pk0 = sbase + R * n_first
    pk1 = sbase + R * tl.maximum(n_last, n_first)
    qn_lo, qn_hi = _n_range(sbase, ncl, QLO, QHI, R)
    band_hi = qn_hi  # sliding: query tiles ending below this lie inside every key's window
    if F.CAUSAL:  # (LC: the class steps earlier configs own, a diagonal moved up)
        qn_lo = tl.maximum(qn_lo, n_first + LC)  # queries n >= the first key's n + LC
        full_lo = blk * BN + BN - 1 + LC  # query tiles starting here see no diagonal
    else:
        full_lo = qn_lo
        if F.SLIDING:
            qn_lo = tl.maximum(qn_lo, n_first - LB)
            full_lo = blk * BN + BN - 1 - LB  # from here: above every key's window edge
    if F.SLIDING:
        qn_hi = tl.minimum(qn_hi, n_last + LB + 1)
        band_hi = blk * BN + LB + 1
    qn_hi = tl.where(n_last >= n_first, qn_hi, qn_lo)

    dk_acc = tl.zeros([BN, D], tl.float32)
    dv_acc = tl.zeros([BN, D], tl.float32)
    for hh in range(GROUP):
        h = hk * GROUP + hh
        h64 = h.to(tl.int64)
        if F.PER_HEAD:
            active = ((h + HBASE) % R) == c
        else:
            active = h >= 0
        if active:
            q_base = q.ptr + b64 * q.sb + h64 * q.sh
            do_base = do.ptr + b64 * do.sb + h64 * do.sh
            lrow = b64 * lse.sb + h64 * lse.sh  # lse and delta: [B, Hq, Sq], one layout
            cols = (kt, vt, kd, offs_n, pk, pk0, pk1, sbase, R, h + HBASE, b64, scales, LB, LC)
            qside = (q_base, do_base, pos.QINV, pos.QDOC, lse.ptr, delta.ptr, lrow, pos.sqinv,
                     pos.sqdoc, q.ss, do.ss, QOFF)
            if F.EARLIER == 0:
                # first config in priority order: no union test, nothing skipped; the diagonal
                # tiles (masked), then whole unmasked tiles
                a_mid = tl.minimum(qn_lo + tl.maximum(full_lo - qn_lo + BM - 1, 0) // BM * BM, qn_hi)
                a_tail = _band_tail(a_mid, qn_hi, band_hi, BM=BM)
                dk_acc, dv_acc = _dkdv_span(dk_acc, dv_acc, cols, qside,
                                            (CFG, NPRI, KEYS, PSZ, pk, pk, pk, pk), qn_lo, a_mid,
                                            a_tail, qn_hi, qn_lo, qn_lo, BM=BM, D=D, UNION=False,
                                            UTAB=0, F=F)
            else:
                dk_acc, dv_acc = _dkdv_union(dk_acc, dv_acc, cols, qside, col_ok, qn_lo, qn_hi,
                                             full_lo, band_hi, CFG, NPRI, KEYS, PSZ, BM=BM, D=D,
                                             UTAB=F.UTAB, F=F)
    dk_acc = dk_acc * scales[0]
    NLAUNCHED, FIRST, LAST = _launch_order(L)
    ka_ptrs = _row_ptrs(dkacc, b64, hkl, kidx, D=D)
    va_ptrs = _row_ptrs(dvacc, b64, hkl, kidx, D=D)
    if F.SINK:  # the sink keys' dk/dv, summed by the dq kernel's sink launch
        SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
        sink = col_ok & (pk < SINKS)
        sg = _row_ptrs(sinkg, b64, hk, pk, D=D)
        dk_acc += tl.load(sg, mask=sink[:, None], other=0.0)
        dv_acc += tl.load(sg + SINKS * sinkg.ss, mask=sink[:, None], other=0.0)
    if FIRST == 0:  # the rows earlier launches (or the caller: merging) wrote
        prev = col_ok & _participates(pk, hk * GROUP + HBASE, GROUP, LCFG, NLAUNCHED,
                                      PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING)
        dk_acc += tl.load(ka_ptrs, mask=prev[:, None], other=0.0)
        dv_acc += tl.load(va_ptrs, mask=prev[:, None], other=0.0)
    if LAST != 0:
        tl.store(_row_ptrs(dk, b64, hk, kidx, D=D), dk_acc.to(dk.ptr.dtype.element_ty),
                 mask=col_ok[:, None])
        tl.store(_row_ptrs(dv, b64, hk, kidx, D=D), dv_acc.to(dv.ptr.dtype.element_ty),
                 mask=col_ok[:, None])
    else:
        tl.store(ka_ptrs, dk_acc, mask=col_ok[:, None])
        tl.store(va_ptrs, dv_acc, mask=col_ok[:, None])
