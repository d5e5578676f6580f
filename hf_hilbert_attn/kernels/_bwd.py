"""Backward kernels (FlashAttention-2 style), one launch of each per config, and their launch.

``P`` is recomputed with the FINAL lse, so every pair gets its true probability whichever
config owns it; ``delta = rowsum(dO * O) - dlse`` uses the final output. The configs own
disjoint pairs (union rule), so their gradient contributions simply add:

* ``_dq_kernel``: program per query tile; computes its rows' delta (and writes it for dk/dv);
  sums over configs in a float32 buffer, the last launch (covering every query) writes ``dq``
  in the input dtype;
* ``_dkdv_kernel`` (``_dkdv.py``): program per key tile of one key/value head, over its group's
  query heads that read this class (GQA without atomics or expanded K/V); float32 sums as for dq.
"""

import torch
import triton
import triton.language as tl

from ._calls import (BwdPlan, Call, _blocks, _call_plans, _check_target, _dummy, _fill_skipped,
                     _flags, _head_chunk, _head_runs, _keep, _launch_row, _launch_table,
                     _launches, _prep, _quads, _smem, _strided, _tiles, _trimmed, _union_args,
                     kept_if_captured)
from ._common import (LOG2E, _SCALARS, Strided, _band_split, _dot, _key_range, _key_tile,
                      _kv_bases, _launch_order, _launch_scalars, _launch_sinks, _logits2,
                      _participates, _program_tile, _query_rows, _row_keep, _row_ptrs, _scales,
                      _sink_geometry, _split_at, _union_prologue)
from . import _dkdv_wgmma
from ._config import _run, kernel_config
from ._dkdv import _dkdv_kernel
from ._launch import relaunch_kept
from ._plan import W_CAP, PositionPlan


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
            pq, pq1, m_first, m_last, R, SKLO, SKHI, CAUSAL=F.CAUSAL)
        s_rows = (qt, dot, lse2, dlt, qd, s_offs, pq, s_p0, s_p1, s_base, s_r, hc, b64, scales,
                  s_lb, 0, s_band, sgk, sgv)
        dq_acc = _dq_tiles(dq_acc, s_rows, keys, (CFG, NCFG, KEYS, PSZ, pq, pq, pq, pq), SKLO,
                           s_hi, s_hi, BN=16, D=D, EDGE=True, UNION=True, UTAB=-1, KVGRAD=True,
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
        prev = row_ok & _participates(pq, hc, 1, LCFG, NLAUNCHED, PER_HEAD=F.PER_HEAD,
                                      SLIDING=F.SLIDING)
        dq_acc += tl.load(acc_ptrs, mask=prev[:, None], other=0.0)
    if LAST != 0:
        tl.store(_row_ptrs(dq, b64, h, qidx, D=D), dq_acc.to(dq.ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        tl.store(acc_ptrs, dq_acc, mask=row_ok[:, None])


def _sum_buffers(B, hch, kch, SQ, SK, D, device):
    """The backward's float32 sums over configs, dq's ``[B, hch, SQ, D]`` and dk's and dv's
    ``[B, kch, SK, D]``, as views of one workspace: every dq launch precedes every dk/dv launch
    on the stream, so the dk/dv sums reuse the dq sum's memory (docs/kernels.md)."""
    nq, nk = B * hch * SQ * D, B * kch * SK * D
    work = torch.empty(max(nq, 2 * nk), device=device, dtype=torch.float32)
    v = lambda h, s, o=0: work.as_strided((B, h, s, D), (h * s * D, s * D, D, 1), o)  # noqa: E731
    return v(hch, SQ), v(kch, SK), v(kch, SK, nk)  # (as_strided: one dispatch a view)


def plan_bwd(c: Call) -> BwdPlan:
    """The backward's launches of call ``c``: a pure function of it."""
    B, HQ, HKV, SQ, SK, D = c.shape
    prio, launch, sinks = _launches(c.pattern, c.plan, c.causal)
    # heads per chunk of the float32 buffers (query / key-value heads; merge: the caller's dq)
    hch = HQ if c.merge else _head_chunk(HQ, B * SQ * D, len(launch), c.cfg)
    kv_merge = c.merge_kv and not sinks
    kch = HKV if kv_merge else _head_chunk(HKV, 2 * B * SK * D, len(launch), c.cfg)
    smem = _smem(c.device, c.cfg)
    dq_tiles = {p: _blocks("dq", D, c.dtype, smem, p, cfg=c.cfg) for p in (False, True)}
    kv_tiles = {f: _blocks("dkdv", D, c.dtype, smem, skips=f, cfg=c.cfg) for f in (False, True)}
    # union test: the key tables hold the configs but the last (up to four earlier ones);
    # the sink launch (after all of them in priority), sliding windows and longer patterns
    # test the configs in a runtime loop (decisions.md, "One union test in a loop")
    keys, psz, utab = _union_args(prio, c.plan, c.device, not c.pattern.sliding)

    # dq: one program per query tile, as in the forward, a chunk of heads at a time (first:
    # the sink launch's dk/dv sums are needed by the dk/dv kernel)
    dq_items, rows = [], []
    for h0, nh in _head_runs(HQ, HQ // HKV, c.skip, hch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, c.merge, bool(sinks) and li == len(launch) - 1)
            if lp is None:
                continue
            BM, BN, warps, stages = dq_tiles[ln.pair]
            seg0, nseg, blk0, nblk = _tiles(lp.qlo, lp.qhi, ln.w, ln.r, BM, True)
            ncls = 1 if c.pattern.query_dilation == "per_head" else ln.r
            rows.append(_launch_row(c, lp, ln, li, len(launch), h0, nh, (seg0, ncls, nblk, blk0),
                                    sinks, len(prio), psz, c.merge))
            fl = _flags(c, prio, ln, BM, bool(sinks) and li == len(launch) - 1, utab)
            kw = dict(BM=BM, BN=BN, D=D, F=fl, num_warps=warps, num_stages=stages)
            dq_items.append(((nseg * ncls * nblk, B * nh), kw))
    # dk, dv: one program per key tile of one key/value head, a chunk of heads at a time
    # per_head: programs for the classes a group's query heads read; the sink keys' dk/dv sums
    # in the first launch if it has one for every key, else the last (the band's: 4 % slower, D83)
    kv_items, kv_alt, kcls = [], [], [min(ln.r, HQ // HKV) if c.pattern.query_dilation ==
                                      "per_head" else ln.r for ln in launch]
    sink_li = 0 if kcls[0] == launch[0].r else len(launch) - 1
    for g0, ng in _head_runs(HKV, 1, c.skip, kch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, kv_merge, False)  # kv_merge: no sink key
            if lp is None:
                continue
            # Hopper: the Gluon kernel where it covers the launch, on its key tiles (the flags'
            # MIXED is the tile's), the Triton one's keywords kept (run's `aligned`)
            fl = _flags(c, prio, ln, _dkdv_wgmma.BN, bool(sinks) and li == sink_li, utab)
            wg = _dkdv_wgmma.eligible(fl, c)
            fl = fl if wg else _flags(c, prio, ln, kv_tiles[False][1], fl.SINK, utab)
            bm, bn, warps, stages = _dkdv_wgmma.TRITON_TILE if wg else \
                kv_tiles[fl.EARLIER and not fl.MIXED]
            kseg0, knseg, kblk0, knblk = _tiles(lp.klo, lp.khi, ln.w, ln.r, bn, ln.w == W_CAP)
            rows.append(_launch_row(c, lp, ln, li, len(launch), g0, ng, (kseg0, kcls[li], knblk,
                                    kblk0), sinks, len(prio), psz, kv_merge))
            kw = dict(BM=bm, BN=bn, D=D, F=fl, num_warps=warps, num_stages=stages)
            kv_alt.append(kw if wg else None)
            kw = dict(BM=_dkdv_wgmma.BM_MIXED if fl.MIXED else _dkdv_wgmma.BM, BN=bn, D=D, F=fl,
                      num_warps=_dkdv_wgmma.WARPS) if wg \
                else kw
            kv_items.append(((knseg * kcls[li] * knblk, B * ng), kw))
    # (the dq launches, then the dk/dv launches)
    tables, items = _launch_table(prio, launch, keys, dq_items + kv_items, rows, c.device)
    dq_items, kv_items = items[:len(dq_items)], items[len(dq_items):]
    chunks = (0 if c.merge else hch, 0 if kv_merge else kch) if len(launch) > 1 else None
    return BwdPlan(tables, sinks, chunks, dq_items, kv_items, kv_merge,
                   bool(sinks) and (c.merge or len(launch) == 1), tuple(kv_alt))


def _bwd_heads(v, sg, none, lead=()) -> tuple:
    """The heads of the backward's launches — dq, dk/dv, then the dense heads' dq and dk/dv —
    from ``v``: the ``Strided`` arguments of ``q k v do lse delta out dq``, the float32 sums
    ``dq dk dv``, then ``dk dv`` and the lse gradient (or delta, unread), or their launcher
    values (``_quads``); ``sg`` the sink keys' sums, ``none`` an unused one, ``lead`` the
    position tables."""
    ins = v[:6]
    return ((*ins, v[7], v[8], sg, v[6], v[13], *lead),
            (*ins, v[11], v[12], v[9], v[10], sg, *lead),
            (*ins, v[7], v[7], none, v[6], v[13], *lead),
            (*ins, v[11], v[12], v[11], v[12], none, *lead))


def _bwd_stats(lse, B, HQ, SQ, dev):
    """``(lse, delta)`` rows ``[B, Hq, Sq]``, padded to a multiple of 16 (a small copy of lse):
    Triton specialises on strides dividing by 16; one compile serves every length."""
    if SQ % 16 == 0 and lse.is_contiguous():
        return lse, torch.empty((B, HQ, SQ), device=dev, dtype=torch.float32)
    stats = torch.empty((2, B, HQ, -(-SQ // 16) * 16), device=dev, dtype=torch.float32)
    stats[0, :, :, :SQ].copy_(lse)
    return stats[0, :, :, :SQ], stats[1, :, :, :SQ]


def dilated_bwd(do, q, k, v, out, lse, dlse, pattern, scale: float, causal: bool,
                plan: PositionPlan, dq=None, dk=None, dv=None, skip: tuple = (), dq_acc=None,
                dkv_acc=None, head_base: int = 0, softcap: float = 0.0):
    """Backward launches → (dq, dk, dv) in the input dtype (``dlse`` may be None), planned once per
    call key (:func:`plan_bwd`); dense key/value heads as in :func:`dilated_fwd`. ``dq``/``dk``/``dv``: tensors (or views) to write into; float32
    sums over configs hold a chunk of heads at a time (``_sum_buffers``). ``skip``: key/value
    heads not computed (zero gradients). ``dq_acc`` / ``dkv_acc``: float32 sums this call's dq /
    (dk, dv) add into (the ring's pieces; dk/dv in the kernels where no key is a sink);
    ``head_base`` and ``softcap`` as in :func:`dilated_fwd`."""
    for name, g, t, dtype in (("dq", dq, q, q.dtype), ("dk", dk, k, k.dtype),
                              ("dv", dv, v, v.dtype), ("dq_acc", dq_acc, q, torch.float32),
                              *zip(("dk_acc", "dv_acc"), dkv_acc or (), (k, v),
                                   (torch.float32,) * 2)):
        _check_target(name, g, t.shape, dtype)
    if q.shape[2] == 0 or k.shape[2] == 0:  # zero gradients (or the given sums)
        dq, dk, dv = (torch.zeros_like(t) if g is None else g.zero_()
                      for g, t in ((dq, q), (dk, k), (dv, v)))
        return (dq if dq_acc is None else dq_acc), *(dkv_acc or (dk, dv))
    return bwd_runner(q, k, pattern, plan, causal, scale, skip, dq_acc is not None,
                      dkv_acc is not None, head_base, softcap)(
        do, q, k, v, out, lse, dlse, dq, dk, dv, dq_acc, dkv_acc)


def bwd_runner(q, k, pattern, plan: PositionPlan, causal: bool, scale: float, skip: tuple = (),
               merge: bool = False, merge_kv: bool = False, head_base: int = 0,
               softcap: float = 0.0):
    """The backward of calls like this one (as :func:`fwd_runner`; ``Sq``, ``Sk`` > 0):
    ``run(do, q, k, v, out, lse, dlse=None, dq=None, dk=None, dv=None, dq_acc=None,
    dkv_acc=None) -> (dq, dk, dv)`` as :func:`dilated_bwd` says (``dq_acc`` given exactly when
    ``merge``, ``dkv_acc`` when ``merge_kv``)."""
    cfg, bp, dense, fresh, fill, pos, memo, lead, tail = _call_plans(
        plan_bwd, q, k, pattern, plan, causal, scale, skip, (merge, merge_kv), head_base,
        softcap)
    (B, HQ, SQ, D), (HKV, SK), dev = q.shape, k.shape[1:3], q.device
    scales, fresh = _scales(scale, softcap), {0: fresh}
    hot = {}  # as the forward's

    def run(do, q, k, v, out, lse, dlse=None, dq=None, dk=None, dv=None, dq_acc=None,
            dkv_acc=None):
        kept_if_captured(dev, (bp, dense, pos))
        q, k, v, out, do = _prep(q), _prep(k), _prep(v), _prep(out), _prep(do)
        dq = q if merge else torch.empty_like(q) if dq is None else dq  # (merge: q stands in
        # for the unwritten dq, so the kernels' output type stays q's)
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        _fill_skipped(() if merge else fill, HQ // HKV, (dq, 0.0))
        lse, delta = _bwd_stats(lse, B, HQ, SQ, dev)  # (delta: written by the dq launches)
        dl = dlse.contiguous() if dlse is not None else delta
        # The last dq launch also sums the sink keys' dk/dv (float32, atomically, over its
        # query tiles; the first dq launch zeroes them, or they start as zeros); the first dk/dv
        # launch adds them in. The dense heads' launches (one per kernel) write the results in
        # the input dtype and have no sink key.
        sinkg = (torch.zeros if bp.zero_sinks else torch.empty)(
            (B, HKV, 2 * bp.sinks, D), device=dev, dtype=torch.float32) if bp.sinks \
            else _dummy(dev).view(torch.float32)  # (float32 either way: one compile serves)
        if not bp.kv_merge:
            _fill_skipped(fill, 1, (dk, 0.0), (dv, 0.0))
        dqacc, dkacc, dvacc = (dq, dk, dv) if bp.chunks is None else \
            _sum_buffers(B, *bp.chunks, SQ, SK, D, dev)  # (None: one launch per kernel, no sums)
        dqacc = dq_acc if merge else dqacc
        if bp.kv_merge:  # dk, dv: not written (k, v stand in, as q for dq)
            (dkacc, dvacc), dk, dv = dkv_acc, k, v
        ts = (q, k, v, do, lse, delta, out, dq, dqacc, dkacc, dvacc, dk, dv, dl, sinkg)
        st, x = _quads(ts)
        st = (st, dlse is None, do.dtype)
        # as the last call: its kernels
        if (last := hot.get(0)) is not None and last[0] == st and x is not None:
            none = (_dummy(dev).data_ptr(), 0, 0, 0)
            relaunch_kept(last[1], _bwd_heads(x, x[14] if bp.sinks else none, none))
        else:
            none = Strided(_dummy(dev).view(torch.float32), 0, 0, 0)
            heads = _bwd_heads(tuple(_strided(t) for t in ts[:14]),
                               _strided(sinkg) if bp.sinks else none, none, lead)
            launches, which = [], []
            # (the Gluon dk/dv kernel loads q and dO rows 16 bytes at a time: aligned rows only)
            aligned = x is not None and not any(s % 8 for s in st[0][0][:3] + st[0][3][:3])
            for i, p in enumerate((bp, dense)):
                for kernel, items, j in ((_dq_kernel, p.dq_items, 2 * i),
                                         (_dkdv_kernel, p.kv_items, 1 + 2 * i)) if p else ():
                    for (grid, row, ints, kw), alt in zip(items, p.kv_alt if j % 2 else
                                                          (None,) * len(items)):
                        fn, kw = (kernel, kw) if alt is None else \
                            (_dkdv_wgmma.KERNEL, kw) if aligned else (kernel, alt)
                        # (dq with an lse gradient: its HAS_DLSE)
                        launches.append((fn, grid, heads[j], (*tail, p.tables, row, *ints,
                                                              scales),
                                         dict(kw, F=kw["F"]._replace(HAS_DLSE=True))
                                         if dlse is not None and j % 2 == 0 else kw))
                    which += [j] * len(items)
            # (dq with an lse gradient and without: two kernels, the same heads' guards)
            _keep(hot, st, x, lead, _run(launches, fresh.pop(0, False), cfg,
                                         memo.setdefault(dlse is not None, {})), which)
        if dkv_acc is not None and not bp.kv_merge:  # sink keys here: the sums on the host
            dkv_acc[0].add_(dk), dkv_acc[1].add_(dv)
        return (dq_acc if merge else dq), *(dkv_acc or (dk, dv))
    run.stale = lambda: kernel_config() is not cfg  # (configure() replaced it since)
    return run
