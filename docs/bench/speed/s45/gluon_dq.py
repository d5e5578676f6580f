"""A Gluon prototype of the backward's dq kernel (Hopper, sm_90; Triton 3.6's Gluon API): does
the explicit schedule that made dk/dv 35-40 % faster (``kernels/_dkdv_wgmma.py``, D92/D93) pay
for dq too, the backward's largest kernel once dk/dv moved (64K, 32 / 8 heads, D 128, `default`:
dq 11.4 ms against dk/dv 12.3 on an H100)?

One program per (query tile of ``BM`` rows, ``HPP`` query heads, batch) over the key tiles of
``BN`` keys a sliding causal window of ``W`` keys reaches (query ``m`` sees key ``n`` when
``n <= m < n + W``; ``W >= S``: dense causal); q, k, v, dO ``[B, H, S, D]`` contiguous bf16
(query head ``h`` reads key/value head ``h // (Hq / Hkv)``), ``lse2`` (log-sum-exp in base 2)
and ``delta`` ``[B, Hq, S]`` float32; out: dq ``[B, Hq, S, D]`` in **bf16** (the float32 sum
times the softmax scale, rounded once, as the library's last launch writes it).

* The program's rows are fixed: its Q and dO tiles go to shared memory once (the A operands of
  ``S = Q Kᵀ`` and ``dP = dO Vᵀ``), its lse and delta to registers once (two rows a thread, in
  the scores' row layout: no shared-memory hop, unlike dk/dv's per-step lse/delta).
* K and V stream: ``[BN, D]`` tiles through a ring of ``STAGES`` shared-memory buffers
  (``cp.async``, one commit group a tile).
* MODE 0 (the dk/dv kernel's schedule), per step: S(i) and dP(i) issued together as async
  wgmma, one wait (which also retires dQ(i-1)); ``P = exp2(S * scale * log2e - lse2)``,
  ``dS = P * (dP - delta)``; ``dQ += dS K`` issued async with dS as the register operand (kept
  alive until the next wait: a dep of it), left running over the next step's barrier, copy
  issue and ``cp.async`` wait. STAGES 3: tile i+1 issued at the top of step i into the slot
  tile i-2 used, whose dQ product step i-1's wait retired (as the dk/dv kernel's query ring).
  STAGES 2 (BN 128 at D 128, where three slots and Q, dO need 256 KB; or for two programs an
  SM): tile i+1 issued after step i's wait (which retires dQ(i-1), the last reader of that
  slot) and a barrier, so the copy overlaps the softmax terms and dQ(i) only.
* MODE 1 (FA2/FA3's software pipelining inside a warpgroup): S(i+1) and dP(i+1) issued before
  step i's softmax terms, so the tensor cores run them meanwhile (one program an SM at 8 warps:
  nothing else fills them); a wait leaving those two running retires dQ(i-1), then dQ(i) is
  issued and a wait leaving it running retires S(i+1), dP(i+1). Tiles ``STAGES - 1`` ahead
  (STAGES 4 or 3) into the slot dQ(i-1) read. 64 more live registers (the next scores): BN 64
  only (BN 128 spills ~1.5 KB). The scores' loop carry costs 64 register moves a step (an
  unroll by two would remove them).
* The mask only on tiles that meet the diagonal (``n0 + BN - 1 > m0``) or the window's lower
  edge (``n0 + W <= m0 + BM - 1``), a uniform branch; tested on the column's constant part
  (a wgmma accumulator's columns are ``2 * (lane % 4)`` plus per-register immediates, so a row's
  bound ``m - n0 - 2 * (lane % 4)`` is compared against immediates; as the dk/dv kernel).
* ``HPP`` 2 (GQA): two query heads of one key/value group per program, ``BM`` rows each, one
  ``[2 * BM, D]`` MMA tile (rows ``r``: head ``h0 + r // BM``, position ``m0 + r % BM``): each
  K/V tile read once for both heads. ``BM 64 HPP 2`` moves the K/V bytes of ``BM 128 HPP 1``
  (half those of ``BM 64 HPP 1``) with a 64-row tile's band edges (fewer masked / wasted keys).
  Warps: 4 per 64 MMA rows (``BM * HPP`` 128: 8 warps, two warpgroups; 64: 4 warps, where two
  programs an SM fit at STAGES 2 — the hardware then overlaps one's softmax with the other's
  MMAs, at twice the K/V traffic of 128 rows).
* ``DELTA`` 1: the program computes ``delta = rowsum(dO * O)`` from O and writes it (the
  library's dq kernel does: like for like in its timing); 0: reads ``delta``.
* Programs in reverse query order (longest first under dense causal).

Useful FLOP/s of dq: ``3 * 2 * D * pairs`` (S, dP and dQ: 2·D flops a pair each), ``pairs``
the allowed (query, key) pairs of all Hq heads, ``Hq * sum_m min(m + 1, W)`` (``Hq * S(S+1)/2``
dense causal).

    # on an H100: check (float32 reference, PyTorch's bf16 error beside it), then time on the
    # band of 2048 at 16K / 64K against the library's dq kernel on band2048.yaml (profiler)
    python docs/bench/speed/s45/gluon_dq.py --bm 128 64 --bn 64 128 --hpp 1 2 --library
    # dense causal at 16K (against the library's dense pattern)
    python docs/bench/speed/s45/gluon_dq.py --seq 16384 --window 16384 --library --no-check
    # both schedules, two programs an SM (4 warps, 2 stages)
    python docs/bench/speed/s45/gluon_dq.py --bm 128 --bn 64 --mode 0 1 --no-check
    python docs/bench/speed/s45/gluon_dq.py --bm 64 --bn 64 --stages 2
    # anywhere, Triton 3.6 first on PYTHONPATH: registers, spills, shared memory, programs an
    # SM, and each SASS loop with MMAs (instructions, HGMMAs, spill stores / loads)
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s45/gluon_dq.py \
        --compile --bm 64 128 --bn 64 128 --hpp 1 2 --mode 0 1 [--dim 64] [--stages 2]

sm_90 from the CPU (Triton 3.6, D 128; loop = SASS instructions of the key loop): mode 0
BM 128 BN 64 (and BM 64 HPP 2): 175 registers, no spills, 160 KB, loop 419 (20 HGMMA); BN 128:
255 registers, no spills (BM 64 HPP 2: 4 bytes), 192 KB at 2 stages, loop 715 (24 HGMMA); BM 64
HPP 1 (4 warps): 183 registers, loop 422 (2 stages: 182, loop 430, 96 KB, 2 programs an SM,
the only D 128 config with two); mode 1 BN 64:
254 registers (4 warps: 251), no spills, loop 486. D 64: 143-146 registers at BN 64 (loop
375-387), 225-229 at BN 128 (loop 667-671), no spills (mode 1 BN 64: 216-218, loop 442-448).
"""
import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)

LOG2E = 1.4426950408889634
BAND = "docs/bench/speed/s43/patterns/band2048.yaml"


@gluon.jit
def _kv_tile(k_buf, v_buf, k, v, kv_base, kv_off, kj, t, n_tiles, kt_lo, S, BN: gl.constexpr,
             D: gl.constexpr):
    """Key tile ``t`` (keys ``kt_lo + t * BN ..``) of K and V into ``k_buf`` / ``v_buf``,
    asynchronously: one uniform offset on the held per-thread offsets ``kv_off``; keys past
    ``S`` and tiles past ``n_tiles`` as zeros (no global read)."""
    n0 = kt_lo + t * BN
    lim = gl.where(t < n_tiles, S - n0, 0)
    ok = (kj < lim)[:, None]
    step = kv_base + n0 * D
    cp.async_copy_global_to_shared(k_buf, k + step + kv_off, mask=ok)
    cp.async_copy_global_to_shared(v_buf, v + step + kv_off, mask=ok)


@gluon.jit
def _ds(s, dp, lse_r, dl_r, pos_s, n_lane, n_c, n0, m0, W, qk_scale, BM: gl.constexpr,
        BN: gl.constexpr, AOP: gl.constexpr):
    """dS of key tile ``n0`` in bf16, as the dQ MMA's register operand: ``P = exp2(S * scale *
    log2e - lse2)``, masked only where the tile meets the diagonal or the window's lower edge,
    times ``dP - delta``."""
    p = gl.exp2(s * qk_scale - lse_r[:, None])
    # (n - m = n_c - t, t = m - n0 - the lane part: one number a row and thread, compared with
    # the immediates n_c; a tile meets both edges only where W < BM + BN)
    if n0 + BN - 1 > m0:  # the diagonal: n <= m
        p = gl.where(n_c <= pos_s[:, None] - (n0 + n_lane), p, 0.0)
    if n0 + W <= m0 + BM - 1:  # the window's lower edge: m - n <= W - 1
        p = gl.where(n_c >= pos_s[:, None] - (n0 + W - 1 + n_lane), p, 0.0)
    return gl.convert_layout((p * (dp - dl_r[:, None])).to(gl.bfloat16), AOP)


@gluon.jit
def dq_kernel(q, k, v, do, o, lse2, delta, dq, S, W, HQ, HKV, sm_scale,
              BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, HPP: gl.constexpr,
              STAGES: gl.constexpr, DELTA: gl.constexpr, MODE: gl.constexpr):
    R: gl.constexpr = BM * HPP  # MMA rows (HPP heads of BM rows)
    WARPS: gl.constexpr = R // 16  # one warp per 16 rows (a warpgroup per 64)
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                 instr_shape=[16, BN, 16])
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                 instr_shape=[16, D, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
    # row loads: R // WARPS rows a warp; K / V tiles: BN // WARPS rows a warp (16 B a thread)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [R // WARPS, 32 * WARPS // R], [WARPS, 1],
                                        [1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, 8], [BN // WARPS, 32 * WARPS // BN], [WARPS, 1],
                                        [1, 0])
    QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], gl.bfloat16)
    KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)

    nblk = gl.cdiv(S, BM)
    blk = nblk - 1 - gl.program_id(0)  # longest first (dense causal)
    h0 = gl.program_id(1) * HPP
    b = gl.program_id(2)
    hk = h0 // (HQ // HKV)
    m0 = blk * BM
    qk_scale = sm_scale * 1.4426950408889634

    # the program's rows, once: Q and dO into shared memory (delta from O and dO: DELTA 1)
    r_q = gl.arange(0, R, layout=gl.SliceLayout(1, LQ))
    pos_q = m0 + r_q % BM
    row_q = ((b * HQ + h0 + r_q // BM).to(gl.int64) * S + pos_q)
    ok_q = pos_q < S
    off_q = row_q[:, None] * D + gl.arange(0, D, layout=gl.SliceLayout(0, LQ))[None, :]
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [R, D], QS, gl.load(
        q + off_q, mask=ok_q[:, None], other=0.0))
    do_t = gl.load(do + off_q, mask=ok_q[:, None], other=0.0)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [R, D], QS, do_t)
    # lse2 and delta in the scores' row layout (a thread's two rows), held through the loop
    r_s = gl.arange(0, R, layout=gl.SliceLayout(1, SL))
    pos_s = m0 + r_s % BM
    row_s = (b * HQ + h0 + r_s // BM).to(gl.int64) * S + pos_s
    lse_r = gl.load(lse2 + row_s, mask=pos_s < S, other=float("inf"))  # (p = 0 past S)
    if DELTA:
        o_t = gl.load(o + off_q, mask=ok_q[:, None], other=0.0)
        dl_q = gl.sum(o_t.to(gl.float32) * do_t.to(gl.float32), 1)
        gl.store(delta + row_q, dl_q, mask=ok_q)  # (for the dk/dv kernel)
        dl_r = gl.convert_layout(dl_q, gl.SliceLayout(1, SL))
    else:
        dl_r = gl.load(delta + row_s, mask=pos_s < S, other=0.0)

    # the key tiles the window reaches: keys max(0, m0 - W + 1) .. min(S, m0 + BM) - 1
    kt_lo = gl.maximum(m0 - W + 1, 0) // BN * BN
    n_tiles = gl.cdiv(gl.minimum(m0 + BM, S) - kt_lo, BN)
    kv_base = (b * HKV + hk).to(gl.int64) * S * D
    kj = gl.arange(0, BN, layout=gl.SliceLayout(1, LK))
    kv_off = kj[:, None] * D + gl.arange(0, D, layout=gl.SliceLayout(0, LK))[None, :]
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D], KS)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D], KS)
    fence_async_shared()

    # the mask's per-thread parts: a row's position, a column's lane part (2 * (lane % 4)) and
    # its per-register constant part
    n_ar = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
    n_lane = (n_ar & 6)[None, :]
    n_c = (n_ar & -7)[None, :]
    zs = gl.zeros([R, BN], gl.float32, layout=SL)
    dq_acc = warpgroup_mma_init(gl.zeros([R, D], gl.float32, layout=AL))
    ds_prev = gl.zeros([R, BN], gl.bfloat16, layout=AOP)  # the running dQ MMA's operand

    if MODE == 0:
        _kv_tile(k_bufs.index(0), v_bufs.index(0), k, v, kv_base, kv_off, kj, 0, n_tiles, kt_lo,
                 S, BN, D)
        cp.commit_group()
        cur = 0  # (the ring's slots of steps i and i + 1, stepped: no i % STAGES)
        for i in range(n_tiles):
            nxt = gl.where(cur == STAGES - 1, 0, cur + 1)
            if STAGES == 3:
                gl.thread_barrier()  # (every warpgroup retired dQ(i-2), the last reader of nxt)
                _kv_tile(k_bufs.index(nxt), v_bufs.index(nxt), k, v, kv_base, kv_off, kj, i + 1,
                         n_tiles, kt_lo, S, BN, D)
                cp.commit_group()
                cp.wait_group(1)  # tile i in
            else:
                cp.wait_group(0)  # tile i in
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_smem, k_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                              is_async=True)
            dp = warpgroup_mma(do_smem, v_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                               is_async=True)
            s, dp, dq_t, ds_prev = warpgroup_mma_wait(0, deps=(s, dp, dq_acc, ds_prev))
            if STAGES == 2:
                gl.thread_barrier()  # (every warpgroup retired dQ(i-1), the last reader of nxt)
                _kv_tile(k_bufs.index(nxt), v_bufs.index(nxt), k, v, kv_base, kv_off, kj, i + 1,
                         n_tiles, kt_lo, S, BN, D)
                cp.commit_group()
            ds = _ds(s, dp, lse_r, dl_r, pos_s, n_lane, n_c, kt_lo + i * BN, m0, W, qk_scale,
                     BM, BN, AOP)
            dq_acc = warpgroup_mma(ds, k_bufs.index(cur), warpgroup_mma_init(dq_t),
                                   is_async=True)
            ds_prev = ds
            cur = nxt
    else:
        # MODE 1: S(i+1) and dP(i+1) issued before step i's softmax terms (they run on the
        # tensor cores meanwhile); tiles STAGES - 1 ahead, into the slot dQ(i-1) read
        for t in gl.static_range(STAGES - 1):
            _kv_tile(k_bufs.index(t), v_bufs.index(t), k, v, kv_base, kv_off, kj, t, n_tiles,
                     kt_lo, S, BN, D)
            cp.commit_group()
        cp.wait_group(STAGES - 2)  # tile 0 in
        gl.thread_barrier()
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zs, use_acc=False,
                          is_async=True)
        dp = warpgroup_mma(do_smem, v_bufs.index(0).permute((1, 0)), zs, use_acc=False,
                           is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        cur = 0
        prv = STAGES - 1  # (the slot of tile i - 1: tile i + STAGES - 1's)
        for i in range(n_tiles - 1):
            nxt = gl.where(cur == STAGES - 1, 0, cur + 1)
            cp.wait_group(STAGES - 3)  # tile i + 1 in
            gl.thread_barrier()
            fence_async_shared()
            s_n = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zs, use_acc=False,
                                is_async=True)
            dp_n = warpgroup_mma(do_smem, v_bufs.index(nxt).permute((1, 0)), zs, use_acc=False,
                                 is_async=True)
            # retires dQ(i-1) (issued before S(i+1), dP(i+1), which keep running)
            dq_t, ds_prev = warpgroup_mma_wait(2, deps=(dq_acc, ds_prev))
            gl.thread_barrier()  # (every warpgroup retired dQ(i-1), the last reader of prv)
            _kv_tile(k_bufs.index(prv), v_bufs.index(prv), k, v, kv_base, kv_off, kj,
                     i + STAGES - 1, n_tiles, kt_lo, S, BN, D)
            cp.commit_group()
            ds = _ds(s, dp, lse_r, dl_r, pos_s, n_lane, n_c, kt_lo + i * BN, m0, W, qk_scale,
                     BM, BN, AOP)
            dq_acc = warpgroup_mma(ds, k_bufs.index(cur), warpgroup_mma_init(dq_t),
                                   is_async=True)
            ds_prev = ds
            s, dp = warpgroup_mma_wait(1, deps=(s_n, dp_n))  # (dQ(i) keeps running)
            prv = cur
            cur = nxt
        dq_t, ds_prev = warpgroup_mma_wait(0, deps=(dq_acc, ds_prev))
        ds = _ds(s, dp, lse_r, dl_r, pos_s, n_lane, n_c, kt_lo + (n_tiles - 1) * BN, m0, W,
                 qk_scale, BM, BN, AOP)
        dq_acc = warpgroup_mma(ds, k_bufs.index(cur), warpgroup_mma_init(dq_t), is_async=True)
        ds_prev = ds
    dq_t, ds_prev = warpgroup_mma_wait(0, deps=(dq_acc, ds_prev))
    cp.wait_group(0)

    r_o = gl.arange(0, R, layout=gl.SliceLayout(1, AL))
    pos_o = m0 + r_o % BM
    row_o = (b * HQ + h0 + r_o // BM).to(gl.int64) * S + pos_o
    off_o = row_o[:, None] * D + gl.arange(0, D, layout=gl.SliceLayout(0, AL))[None, :]
    gl.store(dq + off_o, (dq_t * sm_scale).to(gl.bfloat16), mask=(pos_o < S)[:, None])


def smem_bytes(rows, bn, d, stages):
    """Shared memory of a program: Q and dO, ``stages`` K and V slots (bf16)."""
    return 2 * rows * d * 2 + stages * 2 * bn * d * 2


def configs(args, d):
    """(BM, BN, HPP, STAGES, MODE) of the arguments: at most 128 MMA rows; ``--stages`` 0: the
    deepest ring that fits an H100's 227 KB a program (mode 0: 3 or 2; mode 1: 4 or 3; mode 1
    needs 3)."""
    if args.cfg:  # (given as they are)
        out = [tuple(int(x) for x in c.split(",")) for c in args.cfg]
        for bm, bn, hpp, st, mode in out:
            assert bm * hpp in (64, 128) and st in ((3, 4) if mode else (2, 3)), (bm, hpp, st)
        return out
    out = []
    for bm, bn, hpp, st, mode in itertools.product(args.bm, args.bn, args.hpp, args.stages,
                                                   args.mode):
        if bm * hpp in (64, 128):
            for depth in ((st,) if st else (4, 3, 2) if mode else (3, 2)):
                if smem_bytes(bm * hpp, bn, d, depth) <= 227 * 1024:
                    break
            cfg = (bm, bn, hpp, depth, mode)
            ok_depth = depth in ((3, 4) if mode else (2, 3))  # (mode 1: tiles i+1.. ahead)
            if smem_bytes(bm * hpp, bn, d, depth) <= 227 * 1024 and ok_depth and cfg not in out:
                out.append(cfg)
    return out


def name(bm, bn, hpp, st, mode, d, delta=None):
    return (f"BM={bm} BN={bn} HPP={hpp} D={d} mode {mode} ({bm * hpp // 16} warps, {st} stages"
            + ("" if delta is None else f", delta {'from O' if delta else 'read'}") + ")")


def dq_gluon(q, k, v, do, o, lse2, delta, window, BM, BN, HPP, STAGES, MODE, DELTA=0):
    B, HQ, S, D = q.shape
    HKV = k.shape[1]
    assert (HQ // HKV) % HPP == 0 and all(t.is_contiguous() for t in (q, k, v, do, o))
    assert STAGES in ((3, 4) if MODE else (2, 3)) and BM * HPP in (64, 128)
    dq = torch.empty_like(q)
    grid = (triton.cdiv(S, BM), HQ // HPP, B)
    dq_kernel[grid](q, k, v, do, o, lse2, delta, dq, S, window, HQ, HKV, D ** -0.5,
                    BM=BM, BN=BN, D=D, HPP=HPP, STAGES=STAGES, DELTA=DELTA, MODE=MODE,
                    num_warps=BM * HPP // 16)
    return dq


def _keep(S, window, device):
    i = torch.arange(S, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] < i[None, :] + window)


def reference(q, k, v, do, window):
    """dq, O, lse in base 2 and delta, in float32 through PyTorch."""
    D, g = q.shape[-1], q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kk.transpose(-1, -2) * D ** -0.5).masked_fill(
        ~_keep(q.shape[2], window, q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = p @ vv
    delta = (do.float() * o).sum(-1)
    ds = p * (do.float() @ vv.transpose(-1, -2) - delta[..., None])
    return ds @ kk * D ** -0.5, o, (lse * LOG2E).contiguous(), delta.contiguous()


def torch_bf16_error(q, k, v, do, window, dqr):
    """PyTorch's own error in bf16 (autograd through masked softmax attention) against the
    float32 reference's ``dqr``: the bar the kernel's error is held to."""
    g = q.shape[1] // k.shape[1]
    q_ = q.detach().clone().requires_grad_()
    s = (q_ @ k.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~_keep(q.shape[2], window, q.device), float("-inf")), -1)
    (p @ v.repeat_interleave(g, 1)).backward(do)
    return float((q_.grad.float() - dqr).abs().max() / dqr.abs().max())


def check(args, gen):
    d = args.dim
    for S, W in ((1000, 300), (777, 777), (1536, 256)):
        q, k, v, do = (torch.randn(1, h, S, d, device="cuda", dtype=torch.bfloat16,
                                   generator=gen) for h in (4, 2, 2, 4))
        dqr, o, lse2, delta = reference(q, k, v, do, W)
        o = o.to(torch.bfloat16)
        for bm, bn, hpp, st, mode in configs(args, d):
            for dm in args.delta:
                dl = delta.clone() if dm == 0 else torch.zeros_like(delta)
                dq = dq_gluon(q, k, v, do, o, lse2, dl, W, bm, bn, hpp, st, mode, DELTA=dm)
                err = float((dq.float() - dqr).abs().max() / dqr.abs().max())
                extra = ""
                if dm:  # the delta it wrote (from the bf16 O: its rounding, not the kernel's)
                    extra = f", delta written {float((dl - delta).abs().max()):.1e} off"
                print(f"check S={S} W={W} {name(bm, bn, hpp, st, mode, d, dm)}: max error / max "
                      f"{err:.2e}{extra}", flush=True)
        print(f"  PyTorch in bf16: max error / max {torch_bf16_error(q, k, v, do, W, dqr):.2e}",
              flush=True)


def pairs(S, W, hq):
    """Allowed (query, key) pairs of ``hq`` heads: ``sum_m min(m + 1, W)``."""
    W = min(W, S)
    return hq * (W * (W + 1) // 2 + (S - W) * W)


def library_dq_ms(S, W, hq, hkv, d, gen, steps=5):
    """The library's ``_dq_kernel`` GPU ms per backward (profiler, the mean of ``steps``) on the
    band of ``W`` (band2048.yaml for W 2048) or dense causal (``DilatedPattern.dense``)."""
    from hf_hilbert_attn import DilatedPattern, dilated_attention
    from hf_hilbert_attn.patterns import as_pattern
    if W >= S:
        pattern = DilatedPattern.dense(S)
    elif W == 2048:
        pattern = as_pattern(BAND)
    else:
        return None
    q, k, v, g = (torch.randn(1, h, S, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for h in (hq, hkv, hkv, hq))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step():
        dilated_attention(q, k, v, pattern, backend="triton").backward(g)

    step()
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "_kernel" in ev.name:
            n = ev.name.split("_kernel")[0].lstrip("_")
            by[n] = by.get(n, 0.0) + ev.device_time / 1e3 / steps
    return by


def timings(args, gen):
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d = args.dim
    for S in args.seq:
        W = min(args.window, S)
        q, k, v, do, o = (torch.randn(1, h, S, d, device="cuda", dtype=torch.bfloat16,
                                      generator=gen) for h in (hq, hkv, hkv, hq, hq))
        lse2 = torch.randn(1, hq, S, device="cuda", generator=gen).abs() + 8.0
        delta = torch.randn(1, hq, S, device="cuda", generator=gen)
        flops = 3 * 2 * d * pairs(S, W, hq)
        for rnd in range(args.rounds):
            for bm, bn, hpp, st, mode in configs(args, d):
                for dm in args.delta:
                    ms = triton.testing.do_bench(
                        lambda: dq_gluon(q, k, v, do, o, lse2, delta, W, bm, bn, hpp, st, mode,
                                         DELTA=dm), rep=300, return_mode="median")
                    print(f"S={S} W={W} {hq}/{hkv} {name(bm, bn, hpp, st, mode, d, dm)}: "
                          f"dq {ms:.3f} ms, "
                          f"{flops / ms / 1e9:.0f} useful TFLOP/s", flush=True)
        del q, k, v, do, o, lse2, delta
        if args.library:
            by = library_dq_ms(S, W, hq, hkv, d, gen)
            if by is None:
                print(f"S={S} W={W}: no library pattern for this window", flush=True)
                continue
            ms = by.get("dq", 0.0)
            parts = "  ".join(f"{n} {t:.3f}" for n, t in sorted(by.items()))
            print(f"S={S} W={W} {hq}/{hkv} D={d} library (Triton _dq_kernel, computes delta): "
                  f"dq {ms:.3f} ms, {flops / ms / 1e9:.0f} useful TFLOP/s   [{parts}]",
                  flush=True)


# --------------------------------------------------------------------------------------------
# --compile: sm_90 without a GPU (ptxas -v; the SASS loops through nvdisasm, by
# docs/bench/speed/s44/gluon_compile_check.py's sass_loops)

def _ptxas():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except Exception:
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "ptxas")


def sass_loops(cubin: bytes):
    """The compile check's (``docs/bench/speed/s44/gluon_compile_check.py``): ``(instructions,
    MMAs, spill stores, spill loads)`` of each SASS loop with an MMA."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s44"))
    from gluon_compile_check import sass_loops as loops
    return loops(cubin)


def compile_only(args):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {n: "*bf16" for n in ("q", "k", "v", "do", "o")}
    sig.update({"lse2": "*fp32", "delta": "*fp32", "dq": "*bf16", "S": "i32", "W": "i32",
                "HQ": "i32", "HKV": "i32", "sm_scale": "fp32"})
    d = args.dim
    for bm, bn, hpp, st, mode in configs(args, d):
        for dm in args.delta:
            const = {"BM": bm, "BN": bn, "D": d, "HPP": hpp, "STAGES": st, "DELTA": dm,
                     "MODE": mode}
            s = dict(sig, **{n: "constexpr" for n in const})
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(9)}  # pointers and S, as
            src = GluonASTSource(dq_kernel, s,  # the launcher specialises them
                                 {(list(s).index(n),): c for n, c in const.items()}, aligned)
            label = name(bm, bn, hpp, st, mode, d, dm)
            try:
                kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": bm * hpp // 16})
            except Exception as e:  # noqa: BLE001 (report and go on)
                print(f"{label}: does not compile: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}", flush=True)
                continue
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(kern.asm["ptx"])
                f.flush()
                log = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                                      os.devnull], capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            nreg, shared = int(regs.group(1)) if regs else 255, kern.metadata.shared
            # programs an SM holds: 64K registers (8 a thread at a time), 228 KB of shared
            # memory (1 KB of it reserved a program)
            per_sm = min(65536 // (-(-nreg // 8) * 8 * 32 * (bm * hpp // 16)),
                         228 * 1024 // (shared + 1024))
            print(f"{label}: {nreg} registers, spills {spill.group(1) if spill else '?'} / "
                  f"{spill.group(2) if spill else '?'} bytes (stores / loads), shared {shared} "
                  f"bytes, {per_sm} program(s) an SM", flush=True)
            for line in log.splitlines():
                if "warning" in line.lower():
                    print(f"  ptxas: {line.strip()}", flush=True)
            for n, mma, stl, ldl in sass_loops(kern.asm["cubin"]):
                print(f"  loop: {n} instructions, {mma} HGMMA, {stl} spill stores, {ldl} spill "
                      "loads", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="sm_90 resources, no GPU needed")
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--window", type=int, default=2048, help="W >= seq: dense causal")
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv")
    ap.add_argument("--dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--bm", type=int, nargs="+", default=[128], help="rows of a head a program")
    ap.add_argument("--bn", type=int, nargs="+", default=[64], help="keys a step")
    ap.add_argument("--hpp", type=int, nargs="+", default=[1], help="query heads a program")
    ap.add_argument("--stages", type=int, nargs="+", default=[0],
                    help="K/V ring depth, 2-4 (0: the deepest that fits; see configs)")
    ap.add_argument("--mode", type=int, nargs="+", default=[0], choices=(0, 1),
                    help="0: S/dP, wait, softmax, dQ left running; 1: S/dP of the next tile "
                         "issued before this one's softmax terms")
    ap.add_argument("--cfg", action="append", default=[],
                    help="BM,BN,HPP,STAGES,MODE (repeatable): these instead of the product of "
                         "--bm, --bn, --hpp, --stages, --mode")
    ap.add_argument("--delta", type=int, nargs="+", default=[0], choices=(0, 1),
                    help="0: read delta; 1: compute it from O (as the library's dq kernel)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds (interleaved)")
    ap.add_argument("--library", action="store_true",
                    help="also the library's dq kernel on the same band / dense (profiler)")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    if args.compile:
        return compile_only(args)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    if not args.no_check:
        check(args, gen)
    timings(args, gen)


if __name__ == "__main__":
    sys.exit(main())
