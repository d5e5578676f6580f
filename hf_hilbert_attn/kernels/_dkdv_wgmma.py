"""The dk/dv kernel on Hopper (sm_90), in Gluon: the launches of ``_dkdv._dkdv_kernel`` without
an earlier config (no union test), at natural positions, without documents or soft-capped
scores, in 16-bit with head size 128. Same arguments, same result; the schedule is explicit:

* ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` issued together and waited for once, while the dv and dk
  products of the step before may still run (Triton's compiler waits for every product before
  each of them);
* the query and output-gradient tiles through a ring of three shared-memory buffers
  (``cp.async``), the next one loading while a step computes;
* the mask only on the tiles that meet the diagonal or a window's edge (a uniform branch), and
  the rows' lse and delta stepped, not recomputed: the step's instructions are what bound it.

32 queries a step against 128 keys, 8 warps, no spills on sm_90. On an H100 at 64K (Hq 32 /
Hkv 8): dk/dv of the band of ``default`` 12.87 → 11.73 ms, of ``default`` 20.59 → 18.20
(docs/decisions.md D92). ``KERNEL`` is None where this Triton is not the one whose Gluon API it
was written for (3.6); ``_bwd.plan_bwd`` then keeps ``_dkdv_kernel``.
"""

import torch
import triton

from ._common import (LOG2E, _kv_program, _launch_order, _launch_scalars, _launch_sinks,
                      _n_range, _participates)

KERNEL = None
BM, BN, WARPS = 32, 128, 8  # queries a step, keys a program, warps (two warpgroups)

if triton.__version__.startswith("3.6."):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_init,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _rows(buf, base, ss, first, R, start, end, BM: gl.constexpr, D: gl.constexpr,
              LOAD: gl.constexpr):
        """Class rows ``start .. start + BM`` (below ``end``; storage row ``first + R * n``,
        ``ss`` apart) of a head at ``base`` into shared buffer ``buf``, asynchronously (rows
        past ``end`` as zeros)."""
        n = start + gl.arange(0, BM, layout=gl.SliceLayout(1, LOAD))
        ok = n < end
        rows = gl.where(ok, first + R * n, 0).to(gl.int64)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        cp.async_copy_global_to_shared(buf, base + rows[:, None] * ss + cols[None, :],
                                       mask=ok[:, None])

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
        dt: gl.constexpr = q.ptr.dtype.element_ty
        CFG, LCFG, KEYS = tables
        HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
        b, hkl, hk, blk, sbase, ncl, c = _kv_program(HOFF, HCH, HBASE, SEG0, NCLS, NBLK, BLK0, W,
                                                     R, GROUP, F.PER_HEAD)
        b64 = b.to(gl.int64)
        hk64 = hk.to(gl.int64)
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
        n_tiles = gl.cdiv(gl.maximum(qn_hi - qn_lo, 0), BM)

        offs_n = blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SL))
        m_ar = gl.arange(0, BM, layout=gl.SliceLayout(0, SL))
        zs = gl.zeros([BN, BM], gl.float32, layout=SL)
        dk_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
        dv_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
        for hh in range(GROUP):
            h = hk * GROUP + hh
            active = ((h + HBASE) % R) == c if F.PER_HEAD else h >= 0
            if active:
                h64 = h.to(gl.int64)
                q_base = q.ptr + b64 * q.sb + h64 * q.sh
                do_base = do.ptr + b64 * do.sb + h64 * do.sh
                first = sbase - QOFF
                # lse and delta ([B, Hq, Sq], one layout) of the head, and the first step's rows
                lrow = b64 * lse.sb + h64 * lse.sh
                lse_h, dl_h = lse.ptr + lrow, delta.ptr + lrow
                rows0 = gl.where(qn_lo + m_ar < qn_hi, first + R * (qn_lo + m_ar), 0)
                _rows(q_bufs.index(0), q_base, q.ss, first, R, qn_lo, qn_hi, BM, D, LOAD)
                _rows(do_bufs.index(0), do_base, do.ss, first, R, qn_lo, qn_hi, BM, D, LOAD)
                cp.commit_group()
                for i in range(n_tiles):
                    cur = i % 3
                    start = qn_lo + i * BM
                    gl.thread_barrier()  # (both warpgroups' products of step i-2 are done)
                    _rows(q_bufs.index((i + 1) % 3), q_base, q.ss, first, R, start + BM, qn_hi,
                          BM, D, LOAD)
                    _rows(do_bufs.index((i + 1) % 3), do_base, do.ss, first, R, start + BM,
                          qn_hi, BM, D, LOAD)
                    cp.commit_group()
                    cp.wait_group(1)  # step i's tiles are in
                    gl.thread_barrier()
                    fence_async_shared()
                    st = warpgroup_mma(k_smem, q_bufs.index(cur).permute((1, 0)), zs,
                                       use_acc=False, is_async=True)
                    dpt = warpgroup_mma(v_smem, do_bufs.index(cur).permute((1, 0)), zs,
                                        use_acc=False, is_async=True)
                    st, dpt, dk_t, dv_t = warpgroup_mma_wait(0, deps=(st, dpt, dk_acc, dv_acc))
                    offs_m = start + m_ar
                    row_ok = offs_m < qn_hi
                    # (rows past the span: lse +inf, so p = 0)
                    lse2 = gl.load(lse_h + (rows0 + i * (R * BM)), mask=row_ok,
                                   other=float("inf")) * LOG2E
                    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
                    dl = gl.load(dl_h + (rows0 + i * (R * BM)), mask=row_ok, other=0.0)
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
                        keep = offs_n[:, None] >= 0
                        if F.CAUSAL:  # (moved by the LC class steps earlier configs own)
                            keep = keep & (offs_n[:, None] + LC <= offs_m[None, :])
                        if F.SLIDING:  # the window: n_q <= n_k + LB (>= n_k - LB non-causal)
                            keep = keep & (offs_m[None, :] <= offs_n[:, None] + LB)
                            if not F.CAUSAL:
                                keep = keep & (offs_m[None, :] >= offs_n[:, None] - LB)
                        pt = gl.where(keep, pt, 0.0)
                    dst = pt * (dpt - dl[None, :])
                    dv_acc = warpgroup_mma(gl.convert_layout(pt.to(dt), AOP), do_bufs.index(cur),
                                           warpgroup_mma_init(dv_t), is_async=True)
                    dk_acc = warpgroup_mma(gl.convert_layout(dst.to(dt), AOP), q_bufs.index(cur),
                                           warpgroup_mma_init(dk_t), is_async=True)
                dk_t, dv_t = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
                dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
                cp.wait_group(0)
                gl.thread_barrier()
        dk_out, dv_out = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
        dk_out = dk_out * scales[0]

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


def eligible(flags, d: int, dtype, device, interpret: bool, override) -> bool:
    """Whether a dk/dv launch with compile-time ``flags`` of a call (head size ``d``, ``dtype``
    on ``device``) runs this kernel: an H100-class GPU, the library's own tiles (no override),
    and a launch it covers (the module's docstring)."""
    return (KERNEL is not None and not interpret and override is None and d == 128
            and dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0)
            and not (flags.EARLIER or flags.MAPPED or flags.HAS_DOC or flags.SOFTCAP
                     or flags.IEEE))
