"""Forward kernel: one launch per config, partial results merged exactly through (out, lse).

Program ``(tile, b*Hq + h)`` owns ``BM`` query positions of one class of one segment of the
config ``(W, R)`` and iterates the key tiles of the same class and segment (causal: up to its
last query). Its partial result covers the pairs the union rule assigns to this config; it is
merged with what earlier launches wrote (``ACC`` float32 and ``LSE``) and written back. The
last launch is the config that covers every query (rate 1 in per_head mode); it writes the
final output in the input dtype and the natural-log LSE. Launched by :func:`fwd_runner` below.
"""

import torch
import triton
import triton.language as tl

from ._calls import (Call, FwdPlan, _blocks, _call_plans, _check_target, _fill_skipped, _flags,
                     _head_chunk, _head_runs, _keep, _launch_row, _launch_table, _launches,
                     _prep, _quads, _smem, _strided, _tiles, _trimmed, _union_args,
                     kept_if_captured)
from ._common import (LN2, LOG2E, _SCALARS, _band_split, _key_range, _key_tile, _kv_bases,
                      _launch_order, _launch_scalars, _launch_sinks, _participates, _program_tile,
                      _logits2, _query_rows, _row_keep, _row_ptrs, _scales, _sink_geometry,
                      _split_at, _dot, _union_prologue)
from ._config import _run, kernel_config
from ._launch import relaunch_kept
from ._plan import PositionPlan, fwd_max_registers


@triton.jit
def _fwd_tiles(acc, l_i, m_i, rows, keys, uni, lo, hi, end,
               BN: tl.constexpr, D: tl.constexpr, EDGE: tl.constexpr, UNION: tl.constexpr,
               UTAB: tl.constexpr, F: tl.constexpr):
    """Online softmax over key tiles starting at ``lo, lo+BN, .. < hi``; keys ``n < end``.

    ``EDGE`` tiles need the causal / range-end / window-edge mask; ``UNION`` tiles the per-pair
    union mask. No branch inside the loop, so Triton can software-pipeline the loads. ``rows``:
    the program's queries ``(q, qd, offs_m, pq, p0, p1, sbase, R, h, b64, scales, LB, LC,
    band_lo)`` (``scales``: ``_logits2``'s); ``keys``:
    where keys live ``(k_base, v_base, KINV, KDOC, skinv, skdoc, sks, svs)``; ``uni``: the union
    test ``(CFG, NPRI, KEYS, PSZ, kp0, kp1, kp2, kp3)``.
    """
    q, qd, offs_m, pq, p0, p1, sbase, R, h, b64, scales, LB, LC, band_lo = rows
    for start_n in range(lo, hi, BN):
        offs_n, pk, col_ok, kidx, k, v = _key_tile(start_n, end, sbase, R, b64, keys, BN=BN, D=D,
                                                   EDGE=EDGE, MAPPED=F.MAPPED)
        s = _logits2(_dot(q, tl.trans(k), None, F.IEEE), scales, F.SOFTCAP)[0]
        if EDGE or F.MAPPED == 2 or F.HAS_DOC or UNION:
            keep = _row_keep(offs_m, offs_n, pq, pk, col_ok, qd, kidx, uni, p0, p1, R, h, b64, LB,
                             LC, keys, EDGE=EDGE, UNION=UNION, UTAB=UTAB, F=F)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], F.IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_span(acc, l_i, m_i, rows, keys, uni, lo, b1, mid, end, ma, mb,
              BN: tl.constexpr, D: tl.constexpr, UNION: tl.constexpr, UTAB: tl.constexpr,
              F: tl.constexpr):
    """Key tiles ``[lo, b1)`` masked (sliding: the window's lower edge), ``[b1, mid)`` whole and
    unmasked, then ``[mid, end)`` masked (diagonal, range end). ``UNION``: with the per-pair
    union mask on the masked tiles and on the whole tiles that meet ``[ma, mb)`` only."""
    if F.SLIDING:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, lo, b1, end, BN=BN, D=D,
                                   EDGE=True, UNION=UNION, UTAB=UTAB, F=F)
    if UNION:
        x1, x2 = _split_at(b1, mid, ma, mb, BN=BN)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, b1, x1, end, BN=BN, D=D,
                                   EDGE=False, UNION=False, UTAB=UTAB, F=F)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, x1, x2, end, BN=BN, D=D,
                                   EDGE=False, UNION=True, UTAB=UTAB, F=F)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, x2, mid, end, BN=BN, D=D,
                                   EDGE=False, UNION=False, UTAB=UTAB, F=F)
    else:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, b1, mid, end, BN=BN, D=D,
                                   EDGE=False, UNION=UNION, UTAB=UTAB, F=F)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, rows, keys, uni, mid, end, end, BN=BN, D=D, EDGE=True,
                               UNION=UNION, UTAB=UTAB, F=F)
    return acc, l_i, m_i


@triton.jit
def _fwd_union(acc, l_i, m_i, rows, keys, row_ok, kn_lo, kn_hi, full_hi, CFG, NPRI, KEYS, PSZ,
               BN: tl.constexpr, D: tl.constexpr, UTAB: tl.constexpr, F: tl.constexpr):
    """Key tiles of a config with earlier configs: keys ``[ca, cb)`` covered by them for the
    whole query tile are skipped; the rest is two ranges, each an unmasked run of whole tiles
    then masked tiles (diagonal, range end; sliding: a masked window edge first). ``F.MIXED``
    (the launch may have programs that need the per-pair union mask on whole tiles, decided on
    the host: ``_calls._may_mix``): every program takes the spans with the union code, which
    test it on the masked tiles and on the whole tiles in ``[ma, mb)`` (empty for a program that
    needs none); else none does and the loops carry no union code."""
    q, qd, offs_m, pq, pq0, pq1, sbase, R, h, b64, scales, LB, LC, band_lo = rows
    ca, cb, ma, mb, uni = _union_prologue(pq, row_ok, pq0, pq1, sbase, R, h, kn_hi, CFG, NPRI,
                                          KEYS, PSZ, UTAB=UTAB, F=F, KSIDE=False)
    a_hi = tl.minimum(ca, kn_hi)
    b_lo = tl.maximum(cb, kn_lo)
    a_b1, a_mid = _band_split(kn_lo, full_hi, a_hi, band_lo, BN=BN)
    b_b1, b_mid = _band_split(b_lo, full_hi, kn_hi, band_lo, BN=BN)
    acc, l_i, m_i = _fwd_span(acc, l_i, m_i, rows, keys, uni, kn_lo, a_b1, a_mid, a_hi, ma, mb,
                              BN=BN, D=D, UNION=F.MIXED, UTAB=UTAB, F=F)
    acc, l_i, m_i = _fwd_span(acc, l_i, m_i, rows, keys, uni, b_lo, b_b1, b_mid, kn_hi, ma, mb,
                              BN=BN, D=D, UNION=F.MIXED, UTAB=UTAB, F=F)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_SCALARS)
def _fwd_kernel(q, k, v, o, lse, acc, pos, tables, L, R, LB, LC, NPRI, PSZ, GROUP, QOFF,
                scales, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, F: tl.constexpr):
    """One config's launch. ``q k v o acc``: ``Strided`` ``[B, H, S, D]`` (``acc``: the float32
    partial results of earlier launches, a chunk of heads), ``lse`` ``[B, Hq, Sq]`` (natural
    log); ``pos``: ``Positions``; ``tables``: the configs in priority order, the launched ones
    and the union key tables; ``L``: this launch's row of integers (``_launch_scalars``), then
    the integers the key loops read (``_SCALARS``); ``scales``: the softmax scale as
    ``_common._logits2`` takes it; ``F``: its ``Flags``."""
    CFG, LCFG, KEYS = tables
    HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
    b, hl, h, hc, hk, blk, sbase, ncl = _program_tile(tl.program_id(0), tl.program_id(1), HOFF,
                                                      HCH, HBASE, GROUP, SEG0, NCLS, NBLK, BLK0,
                                                      W, R, PER_HEAD=F.PER_HEAD)
    # ---- query rows: class indices [blk*BM, blk*BM + BM) that exist
    b64, offs_m, pq, row_ok, qidx, qn_lo, qn_hi = _query_rows(b, blk, sbase, ncl, R, QLO, QHI,
                                                              QOFF, pos.QINV, pos.sqinv, BM=BM,
                                                              MAPPED=F.MAPPED)
    qt = tl.load(_row_ptrs(q, b64, h, qidx, D=D), mask=row_ok[:, None], other=0.0)
    if F.HAS_DOC:
        qd = tl.load(pos.QDOC + b64 * pos.sqdoc + qidx, mask=row_ok, other=-2)
    else:
        qd = qidx

    # ---- key range of this tile
    kn_lo, kn_hi, full_hi, band_lo, m_first, m_last, pq0, pq1 = _key_range(
        blk, sbase, ncl, R, qn_lo, qn_hi, KLO, KHI, LB, LC, BM=BM, CAUSAL=F.CAUSAL,
        SLIDING=F.SLIDING)
    k_base, v_base, KDOC_T = _kv_bases(k, v, pos.KDOC, b64, hk, KOFF, MAPPED=F.MAPPED)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    o_acc = tl.zeros([BM, D], tl.float32)
    rows = (qt, qd, offs_m, pq, pq0, pq1, sbase, R, hc, b64, scales, LB, LC, band_lo)
    keys = (k_base, v_base, pos.KINV, KDOC_T, pos.skinv, pos.skdoc, k.ss, v.ss)
    if F.EARLIER == 0:
        # the first config in priority order (rate 1 in longnet_lm): no pair is an earlier
        # config's, so no union test and no skipped range; compiled without them (registers)
        a_b1, a_mid = _band_split(kn_lo, full_hi, kn_hi, band_lo, BN=BN)
        o_acc, l_i, m_i = _fwd_span(o_acc, l_i, m_i, rows, keys,
                                    (CFG, NPRI, KEYS, PSZ, pq, pq, pq, pq), kn_lo, a_b1, a_mid,
                                    kn_hi, kn_lo, kn_lo, BN=BN, D=D, UNION=False, UTAB=0, F=F)
    else:
        o_acc, l_i, m_i = _fwd_union(o_acc, l_i, m_i, rows, keys, row_ok, kn_lo, kn_hi, full_hi,
                                     CFG, NPRI, KEYS, PSZ, BN=BN, D=D, UTAB=F.UTAB, F=F)

    if F.SINK:
        SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
        # ---- the sink keys [SKLO, SKHI) (positions < SINKS), last in priority: the pairs no
        # config allows
        s_offs, s_p0, s_p1, s_base, s_r, s_lb, s_band, s_hi = _sink_geometry(
            pq, pq1, m_first, m_last, R, SKLO, SKHI, CAUSAL=F.CAUSAL)
        s_rows = (qt, qd, s_offs, pq, s_p0, s_p1, s_base, s_r, hc, b64, scales, s_lb, 0, s_band)
        # (16-key tiles: there are few sinks; the union test settles, per program, the configs
        # that reach none of them)
        o_acc, l_i, m_i = _fwd_tiles(o_acc, l_i, m_i, s_rows, keys,
                                     (CFG, NCFG, KEYS, PSZ, pq, pq, pq, pq), SKLO, s_hi, s_hi,
                                     BN=16, D=D, EDGE=True, UNION=True, UTAB=-1, F=F)

    # ---- finish this config's partial, merge with earlier launches, write
    NLAUNCHED, FIRST, LAST = _launch_order(L)
    has = l_i > 0
    lse2 = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    out = o_acc / tl.where(has, l_i, 1.0)[:, None]
    lse_ptrs = lse.ptr + b64 * lse.sb + h.to(tl.int64) * lse.sh + qidx.to(tl.int64) * lse.ss
    acc_ptrs = _row_ptrs(acc, b64, hl, qidx, D=D)
    if FIRST == 0:
        prev = row_ok & _participates(pq, hc, 1, LCFG, NLAUNCHED, PER_HEAD=F.PER_HEAD,
                                      SLIDING=F.SLIDING)
        prev_lse2 = tl.load(lse_ptrs, mask=prev, other=float("-inf")) * LOG2E
        prev_out = tl.load(acc_ptrs, mask=prev[:, None], other=0.0)
        new2 = tl.maximum(prev_lse2, lse2)
        new_safe = tl.where(new2 == float("-inf"), 0.0, new2)
        wa = tl.math.exp2(prev_lse2 - new_safe)
        wb = tl.math.exp2(lse2 - new_safe)
        tot = wa + wb
        lse2 = tl.where(tot > 0, new_safe + tl.math.log2(tl.where(tot > 0, tot, 1.0)), float("-inf"))
        inv = 1.0 / tl.where(tot > 0, tot, 1.0)
        out = prev_out * (wa * inv)[:, None] + out * (wb * inv)[:, None]
    tl.store(lse_ptrs, lse2 * LN2, mask=row_ok)
    if LAST != 0:
        tl.store(_row_ptrs(o, b64, h, qidx, D=D), out.to(o.ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        tl.store(acc_ptrs, out, mask=row_ok[:, None])


def plan_fwd(c: Call) -> FwdPlan:
    """The forward's launches of call ``c``: a pure function of it."""
    B, HQ, HKV, SQ, _, D = c.shape
    prio, launch, sinks = _launches(c.pattern, c.plan, c.causal)
    # merge: the caller's float32 result holds every head (one chunk; skipped heads stay as given)
    hch = HQ if c.merge else _head_chunk(HQ, B * SQ * D, len(launch), c.cfg)
    # the union test: the key tables (as in the backward) for launches that need the per-pair
    # mask, else the runtime loop
    keys, psz, utab = _union_args(prio, c.plan, c.device, any(ln.pair for ln in launch))
    smem = _smem(c.device, c.cfg)
    tiles = {(t, f): _blocks("fwd", D, c.dtype, smem, t, f, cfg=c.cfg)
             for t, f in ((False, False), (True, False), (False, True))}
    items, rows = [], []
    for h0, nh in _head_runs(HQ, HQ // HKV, c.skip, hch):
        for li, ln in enumerate(launch):
            last = li == len(launch) - 1
            lp = _trimmed(c, ln, c.merge, bool(sinks) and last)
            if lp is None:
                continue
            tab = utab if ln.pair else 0
            BM, BN, warps, stages = tiles[tab > 0, ln.npri == 0]
            seg0, nseg, blk0, nblk = _tiles(lp.qlo, lp.qhi, ln.w, ln.r, BM, True)
            ncls = 1 if c.pattern.query_dilation == "per_head" else ln.r
            rows.append(_launch_row(c, lp, ln, li, len(launch), h0, nh, (seg0, ncls, nblk, blk0),
                                    sinks, len(prio), psz, c.merge))
            kw = dict(BM=BM, BN=BN, D=D, F=_flags(c, prio, ln, BM, bool(sinks) and last, tab),
                      num_warps=warps, num_stages=stages)
            cap = fwd_max_registers((BM, BN, warps), ln.npri == 0)
            if cap and c.dtype != torch.float32 and not c.cfg.interpret:
                kw["maxnreg"] = cap
            items.append(((nseg * ncls * nblk, B * nh), kw))
    tables, items = _launch_table(prio, launch, keys, items, rows, c.device)
    return FwdPlan(tables, hch if len(launch) > 1 and not c.merge else 0, items)


def dilated_fwd(q, k, v, pattern, scale: float, causal: bool, plan: PositionPlan, out=None,
                lse=None, skip: tuple = (), acc=None, head_base: int = 0, softcap: float = 0.0):
    """Forward launches. q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` → (out, lse float32 natural log),
    planned once per call key (:func:`plan_fwd`); the pattern's dense key/value heads: one more
    launch of the plain causal config over their heads. ``out`` / ``lse``: tensors to write
    into (unit last stride). ``skip``: key/value heads not computed (out 0, lse -inf). ``acc``: a float32
    result with its given ``lse`` over other keys (0, -inf at first) this call merges into (the
    ring's pieces; ``out`` not written). ``head_base``: query head ``h`` follows the pattern's
    rule as head ``head_base + h`` (a head-sharded rank's heads; dense heads: local indices).
    ``softcap`` > 0: every score ``s`` (scaled) is taken as ``softcap * tanh(s / softcap)``."""
    B, HQ, SQ, _ = q.shape
    for name, t, shape, dtype in (("acc", acc, q.shape, torch.float32), ("out", out, q.shape,
                                  q.dtype), ("lse", lse, q.shape[:3], torch.float32)):
        _check_target(name, t, shape, dtype)
    if SQ == 0:
        lse = torch.empty((B, HQ, 0), device=q.device, dtype=torch.float32) if lse is None else lse
        return (acc if acc is not None else torch.empty_like(q) if out is None else out), lse
    return fwd_runner(q, k, pattern, plan, causal, scale, skip, acc is not None, head_base,
                      softcap)(q, k, v, out, lse, acc)


def fwd_runner(q, k, pattern, plan: PositionPlan, causal: bool, scale: float, skip: tuple = (),
               merge: bool = False, head_base: int = 0, softcap: float = 0.0):
    """The forward of calls like this one (q's and k's shapes, dtype and device, and these
    arguments; ``Sq`` > 0), planned once per call key: ``run(q, k, v, out=None, lse=None,
    acc=None) -> (out, lse)`` launches it as :func:`dilated_fwd` says (``acc``, given exactly
    when ``merge``, in place of ``out``). A caller that repeats a call keeps its runner (ops'
    prepared calls): one lookup of its plans, not one per call, until ``run.stale()`` (the
    configuration it was planned under is no longer :func:`kernel_config`'s)."""
    cfg, fp, dense, fresh, fill, pos, memo, lead, tail = _call_plans(
        plan_fwd, q, k, pattern, plan, causal, scale, skip, (merge,), head_base, softcap)
    (B, HQ, SQ, D), dev, group = q.shape, q.device, q.shape[1] // k.shape[1]
    scales, fresh = _scales(scale, softcap), {0: fresh}  # (the first run compiles side by
    # side; dict.pop with a default: atomic, as threads may share a runner)
    hot = {}  # {0: (strides, launches)}: the last layout launched (layers of a step repeat it;
    # a dict: get and pop are atomic, as threads may share a runner)

    def run(q, k, v, out=None, lse=None, acc=None):
        kept_if_captured(dev, (fp, dense, pos))  # (a CUDA graph replays read them)
        q, k, v = _prep(q), _prep(k), _prep(v)
        out = q if merge else torch.empty_like(q) if out is None else out  # (merge: q stands
        # in for the unwritten out, so the kernels' output type stays q's)
        lse = torch.empty((B, HQ, SQ), device=dev, dtype=torch.float32) if lse is None else lse
        if not merge:  # (fp.hch: the heads of a float32 sum over launches; 0: none)
            _fill_skipped(fill, group, (out, 0.0), (lse, float("-inf")))
            acc = torch.empty((B, fp.hch, SQ, D), device=dev, dtype=torch.float32) \
                if fp.hch else out
        ts = (q, k, v, out, lse, acc)
        st, x = _quads(ts)
        # as the last call: its kernels
        if (last := hot.get(0)) is not None and last[0] == st and x is not None:
            relaunch_kept(last[1], (x[:6], (*x[:5], x[3])))
            return (acc if merge else out), lse
        sv, launches, which = tuple(_strided(t) for t in ts), [], []
        for i, (p, head) in enumerate(((fp, sv), (dense, (*sv[:5], sv[3])))):  # (the sparse
            if p is not None:  # launches merge in acc, the dense heads' write out)
                launches += [(_fwd_kernel, grid, (*head, *lead), (*tail, p.tables, row, *ints,
                                                                  scales), kw)
                             for grid, row, ints, kw in p.items]
                which += [i] * len(p.items)
        _keep(hot, st, x, lead, _run(launches, fresh.pop(0, False), cfg, memo), which)
        return (acc if merge else out), lse
    run.stale = lambda: kernel_config() is not cfg  # (configure() replaced it since)
    return run
