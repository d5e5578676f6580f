"""A Gluon prototype of the backward's dk/dv kernel (issue 34, D91): does an explicit schedule of
Hopper's asynchronous MMAs beat the Triton kernel's, where Triton 3.6 waits for every MMA?

One program per (key tile of 128, key/value head, batch), 8 warps, over its group's query
heads and the query tiles of 32 a sliding causal window of ``W`` keys reaches (query ``m``
sees key ``n`` when ``n <= m < n + W``; ``W = S``: dense causal); q, k, v, dO ``[B, H, S, D]``
contiguous bf16, ``lse2`` (log-sum-exp in base 2) and ``delta`` ``[B, Hq, S]`` float32.

* mode 0: Triton's order — issue S = K Qᵀ and dP = V dOᵀ, wait for both, the
  softmax terms with the tensor cores idle, issue dv / dk (kept pending over the next loads).
* mode 1: tile i+1's S and dP are issued before tile i's softmax terms and its dv /
  dk products; one wait leaves those two pending, so the tensor cores run them while the next
  tile's softmax terms are computed (FlashAttention-3's in-warpgroup overlap, for dk/dv);
  pᵀ and dsᵀ are those MMAs' register operands. Mode 2: the same with pᵀ and dsᵀ stored to
  shared memory (fewer registers live across the wait).

    python docs/bench/speed/s44/gluon_dkdv.py            # on an H100: check and time both
    python docs/bench/speed/s44/gluon_dkdv.py --compile  # anywhere: registers and spills (sm_90)
"""
import argparse
import os
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
MODES = {0: "Triton's order", 1: "overlap, p/ds in registers", 2: "overlap, p/ds in shared memory"}


@gluon.jit
def _load_tile(buf, base, start, S, BM: gl.constexpr, D: gl.constexpr, LOAD: gl.constexpr):
    """Rows ``start .. start+BM`` of a ``[S, D]`` head at ``base`` into ``buf`` (asynchronously;
    rows past ``S`` as zeros)."""
    rows = start + gl.arange(0, BM, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    ptrs = base + rows.to(gl.int64)[:, None] * D + cols[None, :]
    cp.async_copy_global_to_shared(buf, ptrs, mask=(rows < S)[:, None])


@gluon.jit
def _terms(st, dpt, lse2, delta, offs_n, start, S, W, qk_scale, BM: gl.constexpr,
           SL: gl.constexpr, AOP: gl.constexpr, REG: gl.constexpr):
    """pᵀ and dsᵀ of one query tile in bf16: as the dv / dk MMAs' register operands (``REG``),
    else in the scores' layout (for shared memory)."""
    offs_m = start + gl.arange(0, BM, layout=gl.SliceLayout(0, SL))
    l2 = gl.load(lse2 + offs_m, mask=offs_m < S, other=float("inf"))
    dl = gl.load(delta + offs_m, mask=offs_m < S, other=0.0)
    pt = gl.exp2(st * qk_scale - l2[None, :])
    keep = (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] < offs_n[:, None] + W)
    pt = gl.where(keep, pt, 0.0)
    dst = pt * (dpt - dl[None, :])
    pt, dst = pt.to(gl.bfloat16), dst.to(gl.bfloat16)
    if REG:
        pt, dst = gl.convert_layout(pt, AOP), gl.convert_layout(dst, AOP)
    return pt, dst


@gluon.jit
def dkdv_kernel(q, k, v, do, lse2, delta, dk, dv, S, W, GROUP, sm_scale, HKV,
                BN: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, MODE: gl.constexpr):
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                 instr_shape=[16, BM, 16])
    AL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                 instr_shape=[16, D, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=AL, k_width=2)
    KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
    QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], gl.bfloat16)
    NBUF: gl.constexpr = 3
    PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16)
    if MODE == 2:  # pᵀ and dsᵀ through shared memory, two tiles' worth
        p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BM], PS)
        ds_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BM], PS)
    blk = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    n0 = blk * BN
    qk_scale = sm_scale * 1.4426950408889634

    kv_base = (b * HKV + hk).to(gl.int64) * S * D
    rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    kv_off = kv_base + rows.to(gl.int64)[:, None] * D + cols[None, :]
    row_ok = (rows < S)[:, None]
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], KS, gl.load(k + kv_off, mask=row_ok,
                                                                        other=0.0))
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, D], KS, gl.load(v + kv_off, mask=row_ok,
                                                                        other=0.0))
    q_bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BM, D], QS)
    do_bufs = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BM, D], QS)
    fence_async_shared()
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, SL))
    zs = gl.zeros([BN, BM], gl.float32, layout=SL)
    dk_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
    dv_acc = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=AL))
    m_lo = n0 // BM * BM
    m_hi = gl.minimum(S, n0 + BN - 1 + W)
    n_tiles = gl.cdiv(m_hi - m_lo, BM)
    for hh in range(GROUP):
        h = hk * GROUP + hh
        qrow = (b * HKV * GROUP + h).to(gl.int64) * S
        q_base = q + qrow * D
        do_base = do + qrow * D
        l2_base = lse2 + qrow
        dl_base = delta + qrow
        if MODE > 0:
            # tiles 0 and 1 on their way, tile 0's scores
            _load_tile(q_bufs.index(0), q_base, m_lo, S, BM, D, LOAD)
            _load_tile(do_bufs.index(0), do_base, m_lo, S, BM, D, LOAD)
            cp.commit_group()
            _load_tile(q_bufs.index(1), q_base, m_lo + BM, S, BM, D, LOAD)
            _load_tile(do_bufs.index(1), do_base, m_lo + BM, S, BM, D, LOAD)
            cp.commit_group()
            cp.wait_group(1)
            gl.thread_barrier()
            fence_async_shared()
            st = warpgroup_mma(k_smem, q_bufs.index(0).permute((1, 0)), zs, use_acc=False,
                               is_async=True)
            dpt = warpgroup_mma(v_smem, do_bufs.index(0).permute((1, 0)), zs, use_acc=False,
                                is_async=True)
            st, dpt, dk_t, dv_t = warpgroup_mma_wait(0, deps=(st, dpt, dk_acc, dv_acc))
            dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
            p_prev = gl.zeros([BN, BM], gl.bfloat16, layout=AOP)
            ds_prev = gl.zeros([BN, BM], gl.bfloat16, layout=AOP)
            for i in range(n_tiles):
                cur = i % NBUF
                nxt = (i + 1) % NBUF
                start = m_lo + i * BM
                cp.wait_group(0)  # tile i+1 in shared memory
                gl.thread_barrier()
                fence_async_shared()
                st_n = warpgroup_mma(k_smem, q_bufs.index(nxt).permute((1, 0)), zs,
                                     use_acc=False, is_async=True)
                dpt_n = warpgroup_mma(v_smem, do_bufs.index(nxt).permute((1, 0)), zs,
                                      use_acc=False, is_async=True)
                if MODE == 2:
                    pt, dst = _terms(st, dpt, l2_base, dl_base, offs_n, start, S, W, qk_scale,
                                     BM, SL, AOP, False)
                    p_bufs.index(i % 2).store(pt)
                    ds_bufs.index(i % 2).store(dst)
                    fence_async_shared()
                    gl.thread_barrier()
                    dv_acc = warpgroup_mma(p_bufs.index(i % 2), do_bufs.index(cur), dv_acc,
                                           is_async=True)
                    dk_acc = warpgroup_mma(ds_bufs.index(i % 2), q_bufs.index(cur), dk_acc,
                                           is_async=True)
                    st, dpt = warpgroup_mma_wait(2, deps=(st_n, dpt_n))
                else:
                    p_op, ds_op = _terms(st, dpt, l2_base, dl_base, offs_n, start, S, W,
                                         qk_scale, BM, SL, AOP, True)
                    dv_acc = warpgroup_mma(p_op, do_bufs.index(cur), dv_acc, is_async=True)
                    dk_acc = warpgroup_mma(ds_op, q_bufs.index(cur), dk_acc, is_async=True)
                    # retires tile i-1's products: their register operands live until here
                    st, dpt, p_prev, ds_prev = warpgroup_mma_wait(
                        2, deps=(st_n, dpt_n, p_prev, ds_prev))
                    p_prev, ds_prev = p_op, ds_op
                # tile i+2 into the buffer tile i-1's products (retired above, in both
                # warpgroups once past the barrier) read
                gl.thread_barrier()
                _load_tile(q_bufs.index((i + 2) % NBUF), q_base, start + 2 * BM, S, BM, D, LOAD)
                _load_tile(do_bufs.index((i + 2) % NBUF), do_base, start + 2 * BM, S, BM, D,
                           LOAD)
                cp.commit_group()
            dk_t, dv_t, p_prev, ds_prev = warpgroup_mma_wait(
                0, deps=(dk_acc, dv_acc, p_prev, ds_prev))
            dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
            cp.wait_group(0)
            gl.thread_barrier()
        else:
            _load_tile(q_bufs.index(0), q_base, m_lo, S, BM, D, LOAD)
            _load_tile(do_bufs.index(0), do_base, m_lo, S, BM, D, LOAD)
            cp.commit_group()
            for i in range(n_tiles):
                cur = i % NBUF
                start = m_lo + i * BM
                gl.thread_barrier()  # (both warpgroups retired tile i-2's products)
                _load_tile(q_bufs.index((i + 1) % NBUF), q_base, start + BM, S, BM, D, LOAD)
                _load_tile(do_bufs.index((i + 1) % NBUF), do_base, start + BM, S, BM, D, LOAD)
                cp.commit_group()
                cp.wait_group(1)  # tile i in shared memory
                gl.thread_barrier()
                fence_async_shared()
                st = warpgroup_mma(k_smem, q_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                                   is_async=True)
                dpt = warpgroup_mma(v_smem, do_bufs.index(cur).permute((1, 0)), zs,
                                    use_acc=False, is_async=True)
                st, dpt, dk_t, dv_t = warpgroup_mma_wait(0, deps=(st, dpt, dk_acc, dv_acc))
                dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
                p_op, ds_op = _terms(st, dpt, l2_base, dl_base, offs_n, start, S, W, qk_scale,
                                     BM, SL, AOP, True)
                dv_acc = warpgroup_mma(p_op, do_bufs.index(cur), dv_acc, is_async=True)
                dk_acc = warpgroup_mma(ds_op, q_bufs.index(cur), dk_acc, is_async=True)
            dk_t, dv_t = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
            dk_acc, dv_acc = warpgroup_mma_init(dk_t), warpgroup_mma_init(dv_t)
            cp.wait_group(0)
            gl.thread_barrier()
    out_rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
    out_cols = gl.arange(0, D, layout=gl.SliceLayout(0, AL))
    out_off = kv_base + out_rows.to(gl.int64)[:, None] * D + out_cols[None, :]
    out_ok = (out_rows < S)[:, None]
    dk_acc, dv_acc = warpgroup_mma_wait(0, deps=(dk_acc, dv_acc))
    gl.store(dk + out_off, (dk_acc * sm_scale).to(gl.bfloat16), mask=out_ok)
    gl.store(dv + out_off, dv_acc.to(gl.bfloat16), mask=out_ok)


def dkdv(q, k, v, do, lse2, delta, window, mode, BN=128, BM=32):
    B, HQ, S, D = q.shape
    HKV = k.shape[1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    grid = (triton.cdiv(S, BN), B * HKV)
    dkdv_kernel[grid](q, k, v, do, lse2, delta, dk, dv, S, window, HQ // HKV, D ** -0.5, HKV,
                      BN=BN, BM=BM, D=D, MODE=mode, num_warps=8)
    return dk, dv


def reference(q, k, v, do, window):
    """dk, dv and (for the kernel) lse in base 2 and delta, in float32 through PyTorch."""
    B, HQ, S, D = q.shape
    g = HQ // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ kk.transpose(-1, -2) * D ** -0.5
    i = torch.arange(S, device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] < i[None, :] + window)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = p @ vv
    delta = (do.float() * o).sum(-1)
    dvr = p.transpose(-1, -2) @ do.float()
    ds = p * (do.float() @ vv.transpose(-1, -2) - delta[..., None])
    dkr = ds.transpose(-1, -2) @ q.float() * D ** -0.5
    fold = lambda t: t.view(B, k.shape[1], g, S, D).sum(2)  # noqa: E731
    return fold(dkr), fold(dvr), (lse * LOG2E).contiguous(), delta.contiguous()


def torch_bf16_error(q, k, v, do, window, dkr, dvr):
    """PyTorch's own error in bf16 (autograd through masked softmax attention) against the
    float32 reference's ``dkr``, ``dvr``: the bar a kernel's error is held to."""
    g, S = q.shape[1] // k.shape[1], q.shape[2]
    k_, v_ = (t.detach().clone().requires_grad_() for t in (k, v))
    i = torch.arange(S, device=q.device)
    keep = (i[None, :] <= i[:, None]) & (i[:, None] < i[None, :] + window)
    s = (q @ k_.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
    (p @ v_.repeat_interleave(g, 1)).backward(do)
    return max(float((a.grad.float() - b).abs().max() / b.abs().max())
               for a, b in ((k_, dkr), (v_, dvr)))


def compile_only(bm):
    """Registers and spills of both schedules for sm_90 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from hf_hilbert_attn.tools.aot import ptxas_path
    sig = {n: "*bf16" for n in ("q", "k", "v", "do")}
    sig.update({"lse2": "*fp32", "delta": "*fp32", "dk": "*bf16", "dv": "*bf16", "S": "i32",
                "W": "i32", "GROUP": "i32", "sm_scale": "fp32", "HKV": "i32"})
    for mode in MODES:
        const = {"BN": 128, "BM": bm, "D": 128, "MODE": mode}
        s = dict(sig, **{n: "constexpr" for n in const})
        aligned = {(i,): [["tt.divisibility", 16]] for i in range(9)}  # pointers and S, as
        src = GluonASTSource(dkdv_kernel, s, {(list(s).index(n),): c for n, c in const.items()},
                             aligned)  # the launcher specialises them
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(kern.asm["ptx"])
            f.flush()
            log = subprocess.run([ptxas_path(90), "-v", "--gpu-name", "sm_90a", f.name, "-o",
                                  os.devnull], capture_output=True, text=True).stderr
        info = " ".join(line.split("ptxas info    : ")[-1] for line in log.splitlines()[-3:])
        info += "".join(f"\n  {line}" for line in log.splitlines() if "warning" in line)
        print(f"BM={bm} mode {mode} ({MODES[mode]}): {info}; shared {kern.metadata.shared} bytes",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--seq", type=int, nargs="+", default=[65536])
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--bm", type=int, nargs="+", default=[32], help="queries per step")
    args = ap.parse_args()
    if args.compile:
        return [compile_only(bm) for bm in args.bm] and None
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    # correctness on a small odd shape, both schedules, window and dense causal
    for S, W in ((1000, 300), (777, 777)):
        q, k, v, do = (torch.randn(1, h, S, 128, device="cuda", dtype=torch.bfloat16,
                                   generator=gen) for h in (4, 2, 2, 4))
        dkr, dvr, lse2, delta = reference(q, k, v, do, W)
        for bm in args.bm:
            for mode in MODES:
                dk, dv = dkdv(q, k, v, do, lse2, delta, W, mode, BM=bm)
                err = max(float((a.float() - b).abs().max() / b.abs().max())
                          for a, b in ((dk, dkr), (dv, dvr)))
                print(f"check S={S} W={W} BM={bm} mode {mode}: max error / max {err:.2e}",
                      flush=True)
        # PyTorch's error in bf16 on the same data (autograd through masked softmax attention)
        err = torch_bf16_error(q, k, v, do, W, dkr, dvr)
        print(f"  PyTorch in bf16: max error / max {err:.2e}", flush=True)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    for S in args.seq:
        q, k, v, do = (torch.randn(1, h, S, 128, device="cuda", dtype=torch.bfloat16,
                                   generator=gen) for h in (hq, hkv, hkv, hq))
        lse2 = torch.randn(1, hq, S, device="cuda", generator=gen).abs() + 8.0
        delta = torch.randn(1, hq, S, device="cuda", generator=gen)
        pairs = hq * sum(min(args.window, S - n) for n in range(0, S, 1))  # allowed (m, n)
        for bm, mode in [(bm, o) for bm in args.bm for o in MODES] * 2:
            ms = triton.testing.do_bench(lambda: dkdv(q, k, v, do, lse2, delta, args.window,
                                                      mode, BM=bm), rep=300,
                                         return_mode="median")
            print(f"S={S} W={args.window} {hq}/{hkv} BM={bm} mode {mode}: dk/dv {ms:.3f} ms, "
                  f"{4 * 2 * 128 * pairs / ms / 1e9:.0f} useful TFLOP/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
