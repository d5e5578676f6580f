"""Backward kernels (FlashAttention-2 style), one launch of each per config.

``P`` is recomputed with the FINAL lse, so every pair gets its true probability whichever
config owns it; ``delta = rowsum(dO * O) - dlse`` uses the final output. The configs own
disjoint pairs (union rule), so their gradient contributions simply add:

* ``_dq_kernel``: program per query tile; computes its rows' delta (and writes it for dk/dv);
  sums over configs in a float32 buffer, the last launch (covering every query) writes ``dq``
  in the input dtype;
* ``_dkdv_kernel``: program per key tile of one key/value head, looping over its group's query
  heads that read this class (GQA without atomics or expanded K/V); float32 sums as for dq.
"""

import triton
import triton.language as tl

from ._common import (LOG2E, _SCALARS, _band_split, _band_tail, _key_range, _key_tile,
                      _kv_bases, _launch_order, _launch_scalars, _launch_sinks, _logits2, _n_range,
                      _participates, _program_tile, _query_rows, _row_keep, _row_ptrs, _dot,
                      _sink_geometry, _split_at, _union_keep, _union_prologue, _union_tab)


@triton.jit
def _dq_tiles(dq, rows, keys, uni, lo, hi, end,
              BN: tl.constexpr, D: tl.constexpr, EDGE: tl.constexpr, UNION: tl.constexpr,
              UTAB: tl.constexpr, KVGRAD: tl.constexpr, F: tl.constexpr):
    """dq over key tiles ``lo, lo+BN, .. < hi`` (keys ``n < end``); masks as in ``_fwd_tiles``.

    Keys past ``end`` load as zeros and add nothing to dq, so only the diagonal (and, sliding,
    the window's edges) needs a mask. ``rows``: ``(q, do, lse2, delta, qd, offs_m, pq, p0, p1,
    sbase, R, h, b64, scales, LB, LC, band_lo, sgk, sgv)``; ``keys`` and ``uni`` as in
    ``_fwd._fwd_tiles``. ``KVGRAD`` (the sink keys): this tile's dk/dv too, added atomically
    to the float32 rows ``sgk[pos]`` / ``sgv[pos]`` of its key/value head, which the dk/dv
    kernel's first launch adds in.
    """
    q, do, lse2, delta, qd, offs_m, pq, p0, p1, sbase, R, h, b64, scales, LB, LC, band_lo, \
        sgk, sgv = rows
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        offs_n, pk, col_ok, kidx, k, v = _key_tile(start_n, end, sbase, R, b64, keys, BN=BN, D=D,
                                                   EDGE=EDGE, MAPPED=F.MAPPED)
        s = _dot(q, tl.trans(k), None, F.IEEE)
        dp = _dot(do, tl.trans(v), None, F.IEEE)
        x, dcap = _logits2(s, scales, F.SOFTCAP)
        p = tl.math.exp2(x - lse2[:, None])
        if ((F.CAUSAL and EDGE) or (F.SLIDING and EDGE) or F.MAPPED == 2 or F.HAS_DOC or UNION
                or KVGRAD):
            keep = _row_keep(offs_m, offs_n, pq, pk, col_ok, qd, kidx, uni, p0, p1, R, h, b64, LB,
                             LC, keys, EDGE=EDGE, UNION=UNION, UTAB=UTAB, F=F)
            p = tl.where(keep, p, 0.0)
        ds = p * (dp - delta[:, None])
        if F.SOFTCAP:
            ds = ds * dcap
        dq = _dot(ds.to(k.dtype), k, dq, F.IEEE)
        if KVGRAD:
            # rows of queries that do not exist have q = dO = 0 (no contribution)
            dkp = _dot(tl.trans(ds.to(q.dtype)), q, None, F.IEEE)
            dvp = _dot(tl.trans(p.to(do.dtype)), do, None, F.IEEE)
            sg_rows = pk[:, None].to(tl.int64) * D + offs_d[None, :]
            tl.atomic_add(sgk + sg_rows, dkp * scales[0], mask=col_ok[:, None])
            tl.atomic_add(sgv + sg_rows, dvp, mask=col_ok[:, None])
    return dq


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
                                              PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING)
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
def _dq_span(dq, rows, keys, uni, lo, b1, mid, end, ma, mb, BN: tl.constexpr, D: tl.constexpr,
             UNION: tl.constexpr,
             UTAB: tl.constexpr, F: tl.constexpr):
    """dq over key tiles ``[lo, b1)`` masked (sliding), ``[b1, mid)`` whole, then ``[mid, end)``
    masked (as ``_fwd._fwd_span``)."""
    if F.SLIDING:
        dq = _dq_tiles(dq, rows, keys, uni, lo, b1, end, BN=BN, D=D, EDGE=True, UNION=UNION,
                       UTAB=UTAB, KVGRAD=False, F=F)
    if UNION:
        x1, x2 = _split_at(b1, mid, ma, mb, BN=BN)
        dq = _dq_tiles(dq, rows, keys, uni, b1, x1, end, BN=BN, D=D, EDGE=False, UNION=False,
                       UTAB=UTAB, KVGRAD=False, F=F)
        dq = _dq_tiles(dq, rows, keys, uni, x1, x2, end, BN=BN, D=D, EDGE=False, UNION=True,
                       UTAB=UTAB, KVGRAD=False, F=F)
        dq = _dq_tiles(dq, rows, keys, uni, x2, mid, end, BN=BN, D=D, EDGE=False, UNION=False,
                       UTAB=UTAB, KVGRAD=False, F=F)
    else:
        dq = _dq_tiles(dq, rows, keys, uni, b1, mid, end, BN=BN, D=D, EDGE=False, UNION=UNION,
                       UTAB=UTAB, KVGRAD=False, F=F)
    dq = _dq_tiles(dq, rows, keys, uni, mid, end, end, BN=BN, D=D, EDGE=True, UNION=UNION,
                   UTAB=UTAB, KVGRAD=False, F=F)
    return dq


@triton.jit
def _dq_union(dq, rows, keys, row_ok, kn_lo, kn_hi, full_hi, CFG, NPRI, KEYS, PSZ,
              BN: tl.constexpr, D: tl.constexpr, UTAB: tl.constexpr, F: tl.constexpr):
    """dq over the key tiles of a config with earlier configs (as ``_fwd._fwd_union``)."""
    q, do, lse2, delta, qd, offs_m, pq, pq0, pq1, sbase, R, h, b64, scales, LB, LC, \
        band_lo, sgk, sgv = rows
    ca, cb, ma, mb, uni = _union_prologue(pq, row_ok, pq0, pq1, sbase, R, h, kn_hi, CFG, NPRI,
                                          KEYS, PSZ, UTAB=UTAB, F=F, KSIDE=False)
    a_hi = tl.minimum(ca, kn_hi)
    b_lo = tl.maximum(cb, kn_lo)
    a_b1, a_mid = _band_split(kn_lo, full_hi, a_hi, band_lo, BN=BN)
    b_b1, b_mid = _band_split(b_lo, full_hi, kn_hi, band_lo, BN=BN)
    dq = _dq_span(dq, rows, keys, uni, kn_lo, a_b1, a_mid, a_hi, ma, mb, BN=BN, D=D,
                  UNION=F.MIXED, UTAB=UTAB, F=F)
    dq = _dq_span(dq, rows, keys, uni, b_lo, b_b1, b_mid, kn_hi, ma, mb, BN=BN, D=D,
                  UNION=F.MIXED, UTAB=UTAB, F=F)
    return dq


@triton.jit(do_not_specialize=_SCALARS)
def _dq_kernel(q, k, v, do, lse, delta, dq, dqacc, sinkg, o, dlse, pos, tables, L, R, LB, LC,
               NPRI, PSZ, GROUP, QOFF, scales, BM: tl.constexpr, BN: tl.constexpr,
               D: tl.constexpr, F: tl.constexpr):
    """dq of one config's launch. Arguments as in ``_fwd._fwd_kernel``; ``do``, ``dq``, ``o``:
    ``Strided`` like ``q``, ``lse`` / ``delta`` / ``dlse``: ``[B, Hq, Sq]``, ``dqacc``: the
    float32 sum of earlier launches (a chunk of heads), ``sinkg``: the sink keys' float32 dk/dv
    sums ``[B, Hkv, 2 * SINKS, D]``. A program computes its rows' ``delta = rowsum(dO * O) -
    dlse`` (``F.HAS_DLSE``) and writes it for the dk/dv launches; the call's first launch, when
    a later one takes the sink keys, zeroes their sums."""
    CFG, LCFG, KEYS = tables
    HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
    b, hl, h, hc, hk, blk, sbase, ncl = _program_tile(tl.program_id(0), tl.program_id(1), HOFF,
                                                      HCH, HBASE, GROUP, SEG0, NCLS, NBLK, BLK0,
                                                      W, R, PER_HEAD=F.PER_HEAD)
    b64, offs_m, pq, row_ok, qidx, qn_lo, qn_hi = _query_rows(b, blk, sbase, ncl, R, QLO, QHI,
                                                              QOFF, pos.QINV, pos.sqinv, BM=BM,
                                                              MAPPED=F.MAPPED)
    h64 = h.to(tl.int64)
    row64 = qidx.to(tl.int64)
    qt = tl.load(_row_ptrs(q, b64, h, qidx, D=D), mask=row_ok[:, None], other=0.0)
    dot = tl.load(_row_ptrs(do, b64, h, qidx, D=D), mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(lse.ptr + b64 * lse.sb + h64 * lse.sh + row64 * lse.ss, mask=row_ok,
                   other=0.0) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # empty rows: P = 0
    # delta = rowsum(dO * O) (- dlse), float32: the same in every launch; written for dk/dv
    ot = tl.load(_row_ptrs(o, b64, h, qidx, D=D), mask=row_ok[:, None], other=0.0)
    dlt = tl.sum(ot.to(tl.float32) * dot.to(tl.float32), 1)
    if F.HAS_DLSE:
        dlt = dlt - tl.load(dlse.ptr + b64 * dlse.sb + h64 * dlse.sh + row64 * dlse.ss,
                            mask=row_ok, other=0.0)
    tl.store(delta.ptr + b64 * delta.sb + h64 * delta.sh + row64 * delta.ss, dlt, mask=row_ok)
    if F.HAS_DOC:
        qd = tl.load(pos.QDOC + b64 * pos.sqdoc + qidx, mask=row_ok, other=-2)
    else:
        qd = qidx

    kn_lo, kn_hi, full_hi, band_lo, m_first, m_last, pq0, pq1 = _key_range(
        blk, sbase, ncl, R, qn_lo, qn_hi, KLO, KHI, LB, LC, BM=BM, CAUSAL=F.CAUSAL,
        SLIDING=F.SLIDING)
    k_base, v_base, KDOC_T = _kv_bases(k, v, pos.KDOC, b64, hk, KOFF, MAPPED=F.MAPPED)
    dq_acc = tl.zeros([BM, D], tl.float32)
    rows = (qt, dot, lse2, dlt, qd, offs_m, pq, pq0, pq1, sbase, R, hc, b64, scales, LB, LC,
            band_lo, sinkg.ptr, sinkg.ptr)
    keys = (k_base, v_base, pos.KINV, KDOC_T, pos.skinv, pos.skdoc, k.ss, v.ss)
    if F.EARLIER == 0:  # first config in priority order: no union test, nothing skipped
        a_b1, a_mid = _band_split(kn_lo, full_hi, kn_hi, band_lo, BN=BN)
        dq_acc = _dq_span(dq_acc, rows, keys, (CFG, NPRI, KEYS, PSZ, pq, pq, pq, pq), kn_lo,
                          a_b1, a_mid, kn_hi, kn_lo, kn_lo, BN=BN, D=D, UNION=False, UTAB=0,
                          F=F)
    else:
        dq_acc = _dq_union(dq_acc, rows, keys, row_ok, kn_lo, kn_hi, full_hi, CFG, NPRI, KEYS,
                           PSZ, BN=BN, D=D, UTAB=F.UTAB, F=F)
    if F.SINK:
        SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
        # the sink keys (last in priority, as in the forward); their dk/dv summed atomically
        # into this key/value head's float32 rows
        sgk = sinkg.ptr + b64 * sinkg.sb + hk.to(tl.int64) * sinkg.sh
        sgv = sgk + SINKS * sinkg.ss
        s_offs, s_p0, s_p1, s_base, s_r, s_lb, s_band, s_hi = _sink_geometry(
            pq, pq1, m_first, m_last, SKLO, SKHI, CAUSAL=F.CAUSAL)
        s_rows = (qt, dot, lse2, dlt, qd, s_offs, pq, s_p0, s_p1, s_base, s_r, hc, b64, scales,
                  s_lb, 0, s_band, sgk, sgv)
        dq_acc = _dq_tiles(dq_acc, s_rows, keys, (CFG, NCFG, KEYS, PSZ, pq, pq, pq, pq), SKLO,
                           s_hi, s_hi, BN=16, D=D, EDGE=True, UNION=True, UTAB=0, KVGRAD=True,
                           F=F)
    dq_acc = dq_acc * scales[0]
    NLAUNCHED, FIRST, LAST = _launch_order(L)
    if (FIRST != 0) & (LAST == 0) & (h % GROUP == 0) & (tl.program_id(0) == 0):
        # the sink keys' sums of this key/value head, zeroed before the last launch adds in
        SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
        if SKHI > SKLO:
            for r0 in range(0, 2 * SINKS, 16):
                r = r0 + tl.arange(0, 16)
                tl.store(_row_ptrs(sinkg, b64, hk, r, D=D), tl.zeros([16, D], tl.float32),
                         mask=(r < 2 * SINKS)[:, None])
    acc_ptrs = _row_ptrs(dqacc, b64, hl, qidx, D=D)
    if FIRST == 0:
        prev = row_ok & _participates(pq, hc, LCFG, NLAUNCHED, PER_HEAD=F.PER_HEAD,
                                      SLIDING=F.SLIDING)
        dq_acc += tl.load(acc_ptrs, mask=prev[:, None], other=0.0)
    if LAST != 0:
        tl.store(_row_ptrs(dq, b64, h, qidx, D=D), dq_acc.to(dq.ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        tl.store(acc_ptrs, dq_acc, mask=row_ok[:, None])


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
    # Grid: (segments * R classes * key blocks, B * Hkv). Every key position of [KLO, KHI]
    # belongs to exactly one program, so the first launch writes every row of the buffers.
    CFG, LCFG, KEYS = tables
    HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
    tile = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HCH
    hkl = bhk % HCH  # kv head within this launch's chunk (dkacc/dvacc hold HCH heads)
    hk = HOFF + hkl
    blk = BLK0 + tile % NBLK
    t2 = tile // NBLK
    seg = SEG0 + t2 // R
    c = t2 % R
    sbase = seg * W + c
    ncl = (W - c + R - 1) // R
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
    if F.HAS_DOC:
        kd = tl.load(pos.KDOC + b64 * pos.skdoc + kidx, mask=col_ok, other=-1)
    else:
        kd = kidx

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
    if F.SINK:
        if FIRST != 0:
            # the sink keys' dk/dv, summed by the dq kernel's sink launch
            SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
            sink = col_ok & (pk < SINKS)
            sg = _row_ptrs(sinkg, b64, hk, pk, D=D)
            dk_acc += tl.load(sg, mask=sink[:, None], other=0.0)
            dv_acc += tl.load(sg + SINKS * sinkg.ss, mask=sink[:, None], other=0.0)
    if FIRST == 0:
        dk_acc += tl.load(ka_ptrs, mask=col_ok[:, None], other=0.0)
        dv_acc += tl.load(va_ptrs, mask=col_ok[:, None], other=0.0)
    if LAST != 0:
        tl.store(_row_ptrs(dk, b64, hk, kidx, D=D), dk_acc.to(dk.ptr.dtype.element_ty),
                 mask=col_ok[:, None])
        tl.store(_row_ptrs(dv, b64, hk, kidx, D=D), dv_acc.to(dv.ptr.dtype.element_ty),
                 mask=col_ok[:, None])
    else:
        tl.store(ka_ptrs, dk_acc, mask=col_ok[:, None])
        tl.store(va_ptrs, dv_acc, mask=col_ok[:, None])
