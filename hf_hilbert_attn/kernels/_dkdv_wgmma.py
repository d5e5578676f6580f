"""The dk/dv kernel on Hopper (sm_90), in Gluon: the launches of ``_dkdv._dkdv_kernel`` at
natural positions, without documents or soft-capped scores, in 16-bit at head size 128 or 64 —
without an earlier config, with earlier ones (the query ranges they cover for a whole key tile
skipped) and with the per-pair union mask (``MIXED``: on the steps that meet the diagonal or
the range that needs it). Same arguments, same result; its schedule explicit:

* ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` issued together and waited for once, while the dv and dk
  products of the step before may still run (Triton's compiler waits for every product before
  each of them);
* the query and output-gradient tiles through a ring of three shared-memory buffers
  (``cp.async``), the next one loading while a step computes;
* the mask only on the tiles that meet the diagonal or a window's edge (a uniform branch), and
  a step's lse and delta a step ahead, one row a thread, through shared memory: the step's
  instructions bound it, and what it holds through the loop its registers (64 queries a step).

64 queries a step against 128 keys, 8 warps: no spills in the loops on sm_90 (at most a few bytes
outside them); 32 a step in ``MIXED`` launches (the union test's registers: at 64, 328 bytes of
spills at head size 128). On an H100 at 64K (Hq 32 / Hkv 8), against the Triton kernel in one process: dk/dv
of the band of ``default`` 12.61 → 7.93 ms, of ``default`` 20.38 → 12.26; at head size 64
(Hq 32 / Hkv 8) ``default`` 13.91 → 10.07 with 32 a step (docs/decisions.md D92, D93); with
earlier configs, ``longnet_lm``'s dk/dv 10.18 → 9.32 ms, ``pow2``'s 10.61 → 9.70 (D95); with
``MIXED`` launches too, ``longnet_lm``'s 9.32 → 8.55 (D96).
``KERNEL`` is None where this Triton is not the one whose Gluon API it was written for (3.6);
``_bwd.plan_bwd`` then keeps ``_dkdv_kernel``.
"""

import torch
import triton

from ._common import (LOG2E, _covered, _kv_program, _launch_order, _launch_scalars,
                      _launch_sinks, _n_range, _participates, _union_keep, _union_prologue,
                      _union_tab)

KERNEL = None
BM, BN, WARPS = 64, 128, 8  # queries a step, keys a program, warps (two warpgroups)
BM_MIXED = 32  # queries a step where the per-pair union mask is tested (MIXED: registers)
TRITON_TILE = (32, BN, 8, 2)  # _dkdv_kernel's tile on the same key tiles (rows it cannot load)

if triton.__version__.startswith("3.6."):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_init,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _rows(buf, base, off, ss, row, ok):
        """A step's rows into shared buffer ``buf``, asynchronously: storage row ``row`` (rows
        ``ss`` apart) of a head at ``base``, then ``off`` on (rows not ``ok`` as zeros)."""
        cp.async_copy_global_to_shared(buf, base + row.to(gl.int64) * ss + off, mask=ok[:, None])

    @gluon.jit
    def _at(t, b64, h64, rows, cols):
        """Pointers of ``rows`` (int64, ``[N, 1]``) and ``cols`` (``[1, D]``) of head ``h64``,
        batch ``b64`` of ``t`` (a ``Strided``)."""
        return t.ptr + b64 * t.sb + h64 * t.sh + rows * t.ss + cols

    @gluon.jit
    def _dkdv_wgmma_kernel(q, k, v, do, lse, delta, dk, dv, dkacc, dvacc, sinkg, pos, tables, L,
                           R, LB, LC, NPRI, PSZ, GROUP, QOFF, scales, BM: gl.constexpr,
                           BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr):
        """``_dkdv._dkdv_kernel`` for its launches without earlier configs (the module's
        docstring); its grid, arguments and float32 sums."""
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [8, 1], [1, 0])
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                     instr_shape=[16, BM, 16])
        AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                     instr_shape=[16, D, 16])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
        # the q and dO tiles' cp.async: one row a thread (one pointer; that row's lse and delta)
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [BM // 8, 256 // BM], [8, 1], [1, 0])
        dt: gl.constexpr = q.ptr.dtype.element_ty
        CFG, LCFG, KEYS = tables
        HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
        b, hkl, hk, blk, sbase, ncl, c = _kv_program(HOFF, HCH, HBASE, SEG0, NCLS, NBLK, BLK0, W,
                                                     R, GROUP, F.PER_HEAD)
        b64, hk64 = b.to(gl.int64), hk.to(gl.int64)
        kn_lo, kn_hi = _n_range(sbase, ncl, KLO, KHI, R)

        # the key and value tiles, once, into shared memory
        ks: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
        n_ld = blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LOAD))
        ok_ld = (n_ld >= kn_lo) & (n_ld < kn_hi)
        rows = gl.where(ok_ld, sbase + R * n_ld - KOFF, 0).to(gl.int64)[:, None]
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))[None, :]
        k_smem = gl.allocate_shared_memory(dt, [BN, D], ks, gl.load(
            _at(k, b64, hk64, rows, cols), mask=ok_ld[:, None], other=0.0))
        v_smem = gl.allocate_shared_memory(dt, [BN, D], ks, gl.load(
            _at(v, b64, hk64, rows, cols), mask=ok_ld[:, None], other=0.0))
        qs: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dt)
        q_bufs = gl.allocate_shared_memory(dt, [3, BM, D], qs)
        do_bufs = gl.allocate_shared_memory(dt, [3, BM, D], qs)
        # a step's lse (base 2) and delta, from one row a thread to the scores' columns
        lse_s = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        dl_s = gl.allocate_shared_memory(gl.float32, [BM], lse_s.layout)
        fence_async_shared()

        # the query span of the program's keys (as _dkdv_kernel's)
        n_first = gl.maximum(blk * BN, kn_lo)
        n_last = gl.minimum(blk * BN + BN, kn_hi) - 1
        qn_lo, qn_hi = _n_range(sbase, ncl, QLO, QHI, R)
        if F.CAUSAL:
            qn_lo = gl.maximum(qn_lo, n_first + LC)
        elif F.SLIDING:
            qn_lo = gl.maximum(qn_lo, n_first - LB)
        if F.SLIDING:
            qn_hi = gl.minimum(qn_hi, n_last + LB + 1)
        qn_hi = gl.where(n_last >= n_first, qn_hi, qn_lo)

        offs_n = blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SL))
        pk = sbase + R * offs_n  # (the keys' positions and whether they exist: MIXED's test)
        pk_ok = (offs_n >= kn_lo) & (offs_n < kn_hi)
        # a thread's row's offsets from a step's first (held; a step's part: one uniform number)
        j_ar = gl.arange(0, BM, layout=gl.SliceLayout(1, QL))
        j_rows = R * j_ar
        q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, QL))[None, :]
        q_off = j_rows.to(gl.int64)[:, None] * q.ss + q_cols
        do_off = j_rows.to(gl.int64)[:, None] * do.ss + q_cols
        zs = gl.zeros([BN, BM], gl.float32, layout=SL)
        dk_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
        dv_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
        for hh in range(GROUP):
            h = hk * GROUP + hh
            active = ((h + HBASE) % R) == c if F.PER_HEAD else h >= 0
            # the query ranges: [qn_lo, qn_hi) less, after earlier configs, the queries they
            # cover for the whole key tile; causal and sliding, the covered queries start at 0
            # (the upper range only). MIXED: the per-pair union mask on the steps that meet the
            # diagonal, a window's edge or [ma, mb) (uni: its program-side keys, as
            # _dkdv._dkdv_union's)
            a_hi, b_lo = qn_hi, qn_lo
            pk0, pk1 = sbase + R * n_first, sbase + R * gl.maximum(n_last, n_first)
            if F.MIXED:
                ca, cb, ma, mb, uni = _union_prologue(pk, pk_ok, pk0, pk1, sbase, R, h + HBASE,
                                                      qn_hi, CFG, NPRI, KEYS, PSZ, UTAB=F.UTAB,
                                                      F=F, KSIDE=True)
                a_hi, b_lo = gl.minimum(ca, qn_hi), gl.maximum(cb, qn_lo)
            elif F.EARLIER:
                ca, cb, ma, mb = _covered(pk0, pk1, sbase, R, h + HBASE, qn_hi, CFG, NPRI,
                                          PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING,
                                          CAUSAL=F.CAUSAL, KSIDE=True)
                a_hi, b_lo = gl.minimum(ca, qn_hi), gl.maximum(cb, qn_lo)
            for part in range(1 if F.SLIDING and F.CAUSAL or not F.EARLIER else 0, 2):
                lo = gl.where(part == 0, qn_lo, b_lo)
                hi = gl.where(part == 0, a_hi, qn_hi)
                n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BM)
                if active:
                    h64 = h.to(gl.int64)
                    q_base = q.ptr + b64 * q.sb + h64 * q.sh
                    do_base = do.ptr + b64 * do.sb + h64 * do.sh
                    first = sbase - QOFF
                    # lse and delta ([B, Hq, Sq], one layout) of the head
                    lrow = b64 * lse.sb + h64 * lse.sh
                    lse_h, dl_h = lse.ptr + lrow, delta.ptr + lrow
                    row = first + R * lo
                    ok = j_ar < hi - lo
                    _rows(q_bufs.index(0), q_base, q_off, q.ss, row, ok)
                    _rows(do_bufs.index(0), do_base, do_off, do.ss, row, ok)
                    cp.commit_group()
                    # (rows past the span: lse +inf, so p = 0)
                    lse_n = gl.load(lse_h + row + j_rows, mask=ok, other=float("inf"))
                    dl_n = gl.load(dl_h + row + j_rows, mask=ok, other=0.0)
                    cur = 0  # (the ring's buffers of step i and i + 1, stepped: no i % 3)
                    for i in range(n_tiles):
                        nxt = gl.where(cur == 2, 0, cur + 1)
                        start = lo + i * BM
                        # (step i-2's products done, step i-1's lse, delta read)
                        gl.thread_barrier()
                        lse_n = lse_n * LOG2E
                        lse_s.store(gl.where(lse_n == float("-inf"), float("inf"), lse_n))
                        dl_s.store(dl_n)
                        row_n = first + R * (start + BM)
                        ok_n = j_ar < hi - (start + BM)
                        _rows(q_bufs.index(nxt), q_base, q_off, q.ss, row_n, ok_n)
                        _rows(do_bufs.index(nxt), do_base, do_off, do.ss, row_n, ok_n)
                        cp.commit_group()
                        # the next step's lse and delta, into registers while this step computes
                        lse_n = gl.load(lse_h + row_n + j_rows, mask=ok_n, other=float("inf"))
                        dl_n = gl.load(dl_h + row_n + j_rows, mask=ok_n, other=0.0)
                        cp.wait_group(1)  # step i's tiles are in
                        gl.thread_barrier()
                        fence_async_shared()
                        st = warpgroup_mma(k_smem, q_bufs.index(cur).permute((1, 0)), zs,
                                           use_acc=False, is_async=True)
                        dpt = warpgroup_mma(v_smem, do_bufs.index(cur).permute((1, 0)), zs,
                                            use_acc=False, is_async=True)
                        st, dpt, dk_t, dv_t = warpgroup_mma_wait(0, deps=(st, dpt, dk_acc, dv_acc))
                        lse2 = lse_s.load(gl.SliceLayout(0, SL))
                        dl = dl_s.load(gl.SliceLayout(0, SL))
                        pt = gl.exp2(st * scales[1] - lse2[None, :])
                        # the mask only where the tile meets the diagonal or a window's edge
                        edge = False
                        if F.CAUSAL:
                            edge = start < blk * BN + BN - 1 + LC
                        if F.SLIDING:
                            edge = edge | (start + BM - 1 > blk * BN + LB)
                            if not F.CAUSAL:
                                edge = edge | (start < blk * BN + BN - 1 - LB)
                        if edge:
                            # tested on a column's constant part: a thread's columns (a wgmma
                            # accumulator's) are 2 * (lane % 4) (bits 6) plus constants, so a row's
                            # bounds meet immediates, no column held (m_ar = m_ar & 6 + m_ar & -7)
                            m_ar = gl.arange(0, BM, layout=gl.SliceLayout(0, SL))
                            m_c = (m_ar & -7)[None, :]
                            rel = offs_n[:, None] - (start + (m_ar & 6))[None, :]
                            # n_q >= n_k + LC causal (LC: the class steps earlier configs own),
                            # else n_q >= n_k - LB; the window: n_q <= n_k + LB
                            keep = rel + (LC if F.CAUSAL else -LB) <= m_c
                            if F.SLIDING:
                                keep = keep & (m_c <= rel + LB)
                            pt = gl.where(keep, pt, 0.0)
                        if F.MIXED:
                            if edge | ((start < mb) & (start + BM > ma)):
                                pq = sbase + R * (start + gl.arange(0, BM,
                                                                    layout=gl.SliceLayout(0, SL)))
                                if F.UTAB > 0:
                                    kp0, kp1, kp2, kp3 = uni[4], uni[5], uni[6], uni[7]
                                    union = _union_tab(kp0, kp1, kp2, kp3, KEYS, PSZ, pq,
                                                       UTAB=F.UTAB)
                                else:
                                    union = _union_keep(pq[None, :], pk[:, None], pk0, pk1, R,
                                                        h + HBASE, CFG, NPRI,
                                                        PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING,
                                                        SINK=False)
                                pt = gl.where(union, pt, 0.0)
                        dst = pt * (dpt - dl[None, :])
                        dv_acc = warpgroup_mma(gl.convert_layout(pt.to(dt), AOP),
                                               do_bufs.index(cur), warpgroup_mma_init(dv_t),
                                               is_async=True)
                        dk_acc = warpgroup_mma(gl.convert_layout(dst.to(dt), AOP),
                                               q_bufs.index(cur), warpgroup_mma_init(dk_t),
                                               is_async=True)
                        cur = nxt
                    dk_t, dv_t = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
                    dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
                    cp.wait_group(0)
                    gl.thread_barrier()
        dk_out, dv_out = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
        dk_out = dk_out * scales[0]

        # the program's place anew (held through the loops, it spilled at 64 queries a step)
        HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
        b, hkl, hk, blk, sbase, ncl, c = _kv_program(HOFF, HCH, HBASE, SEG0, NCLS, NBLK, BLK0, W,
                                                     R, GROUP, F.PER_HEAD)
        b64, hk64 = b.to(gl.int64), hk.to(gl.int64)
        kn_lo, kn_hi = _n_range(sbase, ncl, KLO, KHI, R)
        # the sums of earlier launches and the sink keys', then the rows (as _dkdv_kernel)
        n_st = blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
        ok_st = (n_st >= kn_lo) & (n_st < kn_hi)
        pk = sbase + R * n_st
        rows = gl.where(ok_st, pk - KOFF, 0).to(gl.int64)[:, None]
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, AL))[None, :]
        NLAUNCHED, FIRST, LAST = _launch_order(L)
        hkl64 = hkl.to(gl.int64)
        if F.SINK:  # the sink keys' dk/dv, summed by the dq kernel's sink launch
            SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
            sink = (ok_st & (pk < SINKS))[:, None]
            sg = _at(sinkg, b64, hk64, pk.to(gl.int64)[:, None], cols)
            dk_out += gl.load(sg, mask=sink, other=0.0)
            dv_out += gl.load(sg + SINKS * sinkg.ss, mask=sink, other=0.0)
        if FIRST == 0:  # the rows earlier launches (or the caller: merging) wrote
            prev = (ok_st & _participates(pk, hk * GROUP + HBASE, GROUP, LCFG, NLAUNCHED,
                                          PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING))[:, None]
            dk_out += gl.load(_at(dkacc, b64, hkl64, rows, cols), mask=prev, other=0.0)
            dv_out += gl.load(_at(dvacc, b64, hkl64, rows, cols), mask=prev, other=0.0)
        ok = ok_st[:, None]
        if LAST != 0:
            gl.store(_at(dk, b64, hk64, rows, cols), dk_out.to(dk.ptr.dtype.element_ty), mask=ok)
            gl.store(_at(dv, b64, hk64, rows, cols), dv_out.to(dv.ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(_at(dkacc, b64, hkl64, rows, cols), dk_out, mask=ok)
            gl.store(_at(dvacc, b64, hkl64, rows, cols), dv_out, mask=ok)

    KERNEL = _dkdv_wgmma_kernel


def eligible(flags, c) -> bool:
    """Whether a dk/dv launch with compile-time ``flags`` of call ``c`` (a ``_calls.Call``) runs
    this kernel: an H100-class GPU, the library's own tiles (no override), and a launch it covers
    (the module's docstring)."""
    return (KERNEL is not None and not c.cfg.interpret and c.shape[-1] in (64, 128)
            and c.cfg.tile_override("dkdv", False) is None
            and c.dtype in (torch.bfloat16, torch.float16) and c.device.type == "cuda"
            and torch.cuda.get_device_capability(c.device) == (9, 0)
            and not (flags.MAPPED or flags.HAS_DOC or flags.SOFTCAP or flags.IEEE))
