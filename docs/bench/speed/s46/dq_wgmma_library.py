"""The dq kernel on Hopper (sm_90), in Gluon: the launches of ``_bwd._dq_kernel`` without an
earlier config or the sink keys, at natural positions, without documents or soft-capped scores,
in 16-bit at head size 128 or 64. Same arguments, grid and result; its schedule explicit:

* the program's query rows and their output gradients go to shared memory once, their lse and
  delta to registers once;
* the key and value tiles stream through a ring of three shared-memory buffers (``cp.async``),
  the next one loading while a step computes;
* ``S = Q Kᵀ`` and ``dP = dO Vᵀ`` are issued together and waited for once, while the step
  before's ``dQ += dS K`` may still run (Triton's compiler waits for every product first);
* the mask only on the tiles that meet the diagonal or a window's edge (a uniform branch).

``KERNEL`` is None where this Triton is not the one whose Gluon API it was written for (3.6);
``_bwd.plan_bwd`` then keeps ``_dq_kernel`` (docs/decisions.md D94).
"""

import torch
import triton

from hf_hilbert_attn.kernels._common import (LOG2E, _key_range, _launch_order, _launch_scalars, _launch_sinks,
                      _n_range, _participates, _program_tile)

KERNEL = None
BM, BN, STAGES = 128, 64, 3  # queries a program, keys a step, the ring's buffers
WARPS = BM // 16  # a warp per 16 rows (two warpgroups)
TRITON_TILE = (BM, BN, WARPS, 3)  # _dq_kernel's tile on the same query tiles (rows it cannot load)

if triton.__version__.startswith("3.6."):
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  warpgroup_mma,
                                                                  warpgroup_mma_init,
                                                                  warpgroup_mma_wait)

    @gluon.jit
    def _at(t, b64, h64, rows, cols):
        """Pointers of ``rows`` (int64, ``[N, 1]``) and ``cols`` (``[1, D]``) of head ``h64``,
        batch ``b64`` of ``t`` (a ``Strided``)."""
        return t.ptr + b64 * t.sb + h64 * t.sh + rows * t.ss + cols

    @gluon.jit
    def _kv_tile(k_buf, v_buf, k_base, v_base, k_off, v_off, kj, n0, kn_hi, first, R, kss, vss):
        """Key tile ``n0`` (class indices ``n0 ..``, storage rows ``first + R * n``) of K and V
        into ``k_buf`` / ``v_buf``, asynchronously: one uniform offset on the held per-thread
        ones; keys from ``kn_hi`` on as zeros (no global read; they add nothing to dq)."""
        row = (first + R * n0).to(gl.int64)
        ok = (kj < kn_hi - n0)[:, None]
        cp.async_copy_global_to_shared(k_buf, k_base + row * kss + k_off, mask=ok)
        cp.async_copy_global_to_shared(v_buf, v_base + row * vss + v_off, mask=ok)

    @gluon.jit
    def _dq_wgmma_kernel(q, k, v, do, lse, delta, dq, dqacc, sinkg, o, dlse, pos, tables, L, R,
                         LB, LC, NPRI, PSZ, GROUP, QOFF, scales, BM: gl.constexpr,
                         BN: gl.constexpr, D: gl.constexpr, F: gl.constexpr):
        """``_bwd._dq_kernel`` for its launches without earlier configs or sink keys (the
        module's docstring); its grid, arguments and float32 sums."""
        NW: gl.constexpr = BM // 16
        SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                     instr_shape=[16, BN, 16])
        AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                     instr_shape=[16, D, 16])
        AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
        # row loads: 16 bytes a thread, BM // NW query rows and BN // NW key rows a warp
        LQ: gl.constexpr = gl.BlockedLayout([1, 8], [BM // NW, 32 * NW // BM], [NW, 1], [1, 0])
        LK: gl.constexpr = gl.BlockedLayout([1, 8], [BN // NW, 32 * NW // BN], [NW, 1], [1, 0])
        dt: gl.constexpr = q.ptr.dtype.element_ty
        qs: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dt)
        ks: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
        CFG, LCFG, KEYS = tables
        HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
        b, hl, h, hc, hk, blk, sbase, ncl = _program_tile(
            gl.program_id(0), gl.program_id(1), HOFF, HCH, HBASE, GROUP, SEG0, NCLS, NBLK, BLK0,
            W, R, PER_HEAD=F.PER_HEAD)
        b64, h64 = b.to(gl.int64), h.to(gl.int64)
        qn_lo, qn_hi = _n_range(sbase, ncl, QLO, QHI, R)

        # the program's rows, once: Q and dO into shared memory; delta = rowsum(dO * O) (- the
        # lse's gradient), written for the dk/dv launches
        m_q = blk * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LQ))
        ok_q = (m_q >= qn_lo) & (m_q < qn_hi)
        rq = gl.where(ok_q, sbase + R * m_q - QOFF, 0).to(gl.int64)
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))[None, :]
        q_smem = gl.allocate_shared_memory(dt, [BM, D], qs, gl.load(
            _at(q, b64, h64, rq[:, None], cq), mask=ok_q[:, None], other=0.0))
        do_t = gl.load(_at(do, b64, h64, rq[:, None], cq), mask=ok_q[:, None], other=0.0)
        do_smem = gl.allocate_shared_memory(dt, [BM, D], qs, do_t)
        o_t = gl.load(_at(o, b64, h64, rq[:, None], cq), mask=ok_q[:, None], other=0.0)
        dl_q = gl.sum(o_t.to(gl.float32) * do_t.to(gl.float32), 1)
        if F.HAS_DLSE:
            dl_q = dl_q - gl.load(dlse.ptr + b64 * dlse.sb + h64 * dlse.sh + rq * dlse.ss,
                                  mask=ok_q, other=0.0)
        gl.store(delta.ptr + b64 * delta.sb + h64 * delta.sh + rq * delta.ss, dl_q, mask=ok_q)
        dl_r = gl.convert_layout(dl_q, gl.SliceLayout(1, SL))
        # lse (base 2) in the scores' row layout (rows that do not exist or see no key: +inf,
        # so P = 0), and the rows' class indices for the mask
        m_s = blk * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
        ok_s = (m_s >= qn_lo) & (m_s < qn_hi)
        rs = gl.where(ok_s, sbase + R * m_s - QOFF, 0).to(gl.int64)
        lse_r = gl.load(lse.ptr + b64 * lse.sb + h64 * lse.sh + rs * lse.ss, mask=ok_s,
                        other=float("inf")) * LOG2E
        lse_r = gl.where(lse_r == float("-inf"), float("inf"), lse_r)

        # the key tiles: class indices [kn_lo, kn_hi) of this tile's rows, BN a step
        kn_lo, kn_hi, full_hi, band_lo, m_first, m_last, pq0, pq1 = _key_range(
            blk, sbase, ncl, R, qn_lo, qn_hi, KLO, KHI, LB, LC, BM=BM, CAUSAL=F.CAUSAL,
            SLIDING=F.SLIDING)
        n_tiles = gl.cdiv(gl.maximum(kn_hi - kn_lo, 0), BN)
        hk64 = hk.to(gl.int64)
        k_base = k.ptr + b64 * k.sb + hk64 * k.sh
        v_base = v.ptr + b64 * v.sb + hk64 * v.sh
        kj = gl.arange(0, BN, layout=gl.SliceLayout(1, LK))
        ck = gl.arange(0, D, layout=gl.SliceLayout(0, LK))[None, :]
        k_off = (R * kj)[:, None] * k.ss + ck
        v_off = (R * kj)[:, None] * v.ss + ck
        first = sbase - KOFF  # (storage row of class index 0)
        k_bufs = gl.allocate_shared_memory(dt, [3, BN, D], ks)
        v_bufs = gl.allocate_shared_memory(dt, [3, BN, D], ks)
        fence_async_shared()

        # the mask's parts: a column is 2 * (lane % 4) (bits 6) plus a per-register constant
        # (a wgmma accumulator's), so a row's bound meets immediates (no column held)
        n_ar = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
        n_lane = (n_ar & 6)[None, :]
        n_c = (n_ar & -7)[None, :]
        zs = gl.zeros([BM, BN], gl.float32, layout=SL)
        dq_acc = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, layout=AL))
        ds_prev = gl.zeros([BM, BN], dt, layout=AOP)  # (the running dQ product's operand)
        _kv_tile(k_bufs.index(0), v_bufs.index(0), k_base, v_base, k_off, v_off, kj, kn_lo,
                 kn_hi, first, R, k.ss, v.ss)
        cp.commit_group()
        cur = 0  # (the ring's buffers of steps i and i + 1, stepped: no i % 3)
        for i in range(n_tiles):
            n0 = kn_lo + i * BN
            nxt = gl.where(cur == 2, 0, cur + 1)
            gl.thread_barrier()  # (every warpgroup retired dQ(i - 2), the last reader of nxt)
            _kv_tile(k_bufs.index(nxt), v_bufs.index(nxt), k_base, v_base, k_off, v_off, kj,
                     n0 + BN, kn_hi, first, R, k.ss, v.ss)
            cp.commit_group()
            cp.wait_group(1)  # tile i is in
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_smem, k_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                              is_async=True)
            dp = warpgroup_mma(do_smem, v_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                               is_async=True)
            s, dp, dq_t, ds_prev = warpgroup_mma_wait(0, deps=(s, dp, dq_acc, ds_prev))
            p = gl.exp2(s * scales[1] - lse_r[:, None])
            # the mask only where the tile meets the diagonal or a window's edge: key n with
            # n <= m - LC (causal), n >= m - LB (sliding), n <= m + LB (sliding, not causal)
            if F.CAUSAL:
                if n0 + BN - 1 > blk * BM - LC:
                    p = gl.where(n_c <= m_s[:, None] - (n0 + LC + n_lane), p, 0.0)
            if F.SLIDING:
                if n0 < blk * BM + BM - 1 - LB:
                    p = gl.where(n_c >= m_s[:, None] - (n0 + LB + n_lane), p, 0.0)
                if not F.CAUSAL:
                    if n0 + BN - 1 > blk * BM + LB:
                        p = gl.where(n_c <= m_s[:, None] - (n0 - LB + n_lane), p, 0.0)
            ds = gl.convert_layout((p * (dp - dl_r[:, None])).to(dt), AOP)
            dq_acc = warpgroup_mma(ds, k_bufs.index(cur), warpgroup_mma_init(dq_t),
                                   is_async=True)
            ds_prev = ds
            cur = nxt
        dq_t, ds_prev = warpgroup_mma_wait(0, deps=(dq_acc, ds_prev))
        cp.wait_group(0)
        dq_t = dq_t * scales[0]

        # the program's place anew (cheap; not held through the loop), then the sums of
        # earlier launches and the rows (as _dq_kernel)
        HOFF, HCH, HBASE, KOFF, QLO, QHI, KLO, KHI, SEG0, NCLS, NBLK, BLK0, W = _launch_scalars(L)
        b, hl, h, hc, hk, blk, sbase, ncl = _program_tile(
            gl.program_id(0), gl.program_id(1), HOFF, HCH, HBASE, GROUP, SEG0, NCLS, NBLK, BLK0,
            W, R, PER_HEAD=F.PER_HEAD)
        b64, h64 = b.to(gl.int64), h.to(gl.int64)
        qn_lo, qn_hi = _n_range(sbase, ncl, QLO, QHI, R)
        m_o = blk * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, AL))
        ok_o = (m_o >= qn_lo) & (m_o < qn_hi)
        pq = sbase + R * m_o
        ro = gl.where(ok_o, pq - QOFF, 0).to(gl.int64)[:, None]
        co = gl.arange(0, D, layout=gl.SliceLayout(0, AL))[None, :]
        NLAUNCHED, FIRST, LAST = _launch_order(L)
        if (FIRST != 0) & (LAST == 0) & (h % GROUP == 0) & (gl.program_id(0) == 0):
            # the sink keys' sums of this key/value head, zeroed before the sink launch adds in
            SINKS, SKLO, SKHI, NCFG = _launch_sinks(L)
            if SKHI > SKLO:
                for r0 in range(0, 2 * SINKS, BM):
                    r = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, AL))
                    gl.store(_at(sinkg, b64, hk.to(gl.int64), r.to(gl.int64)[:, None], co),
                             gl.zeros([BM, D], gl.float32, layout=AL),
                             mask=(r < 2 * SINKS)[:, None])
        hl64 = hl.to(gl.int64)
        if FIRST == 0:  # the rows earlier launches (or the caller: merging) wrote
            prev = ok_o & _participates(pq, hc, 1, LCFG, NLAUNCHED, PER_HEAD=F.PER_HEAD,
                                        SLIDING=F.SLIDING)
            dq_t += gl.load(_at(dqacc, b64, hl64, ro, co), mask=prev[:, None], other=0.0)
        if LAST != 0:
            gl.store(_at(dq, b64, h64, ro, co), dq_t.to(dq.ptr.dtype.element_ty),
                     mask=ok_o[:, None])
        else:
            gl.store(_at(dqacc, b64, hl64, ro, co), dq_t, mask=ok_o[:, None])

    KERNEL = _dq_wgmma_kernel


def eligible(flags, c) -> bool:
    """Whether a dq launch with compile-time ``flags`` of call ``c`` (a ``_calls.Call``) runs
    this kernel: an H100-class GPU, the library's own tiles (no override), and a launch it covers
    (the module's docstring)."""
    return (KERNEL is not None and not c.cfg.interpret and c.shape[-1] in (64, 128)
            and c.cfg.tile_override("dq", False) is None
            and c.dtype in (torch.bfloat16, torch.float16) and c.device.type == "cuda"
            and torch.cuda.get_device_capability(c.device) == (9, 0)
            and not (flags.EARLIER or flags.SINK or flags.MAPPED or flags.HAS_DOC
                     or flags.SOFTCAP or flags.IEEE))
