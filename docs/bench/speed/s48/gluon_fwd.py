"""Prototype (issue 34): a causal forward in Gluon for Hopper (Triton 3.6), its schedule written
out, against our Triton forward kernel (the library's dense pattern) and SDPA on one H100.

Program: 128 queries (two warpgroups of 64 rows), one query head, causal, natural positions,
GQA by ``h // GROUP``. Key / value tiles of ``BN`` rows stream through a ring of ``NS`` shared
buffers by ``cp.async`` (the next tiles load while a step computes). Two schedules:

* ``OVERLAP=0``: a step issues ``S = Q Kᵀ``, waits, takes the softmax, then issues ``O += P V``
  asynchronously (it runs into the next step's ``S``: what Triton's compiler does at best);
* ``OVERLAP=1`` (FlashAttention-3's in-warpgroup pipelining): step j issues ``S_j = Q K_jᵀ`` and
  then ``O += P_{j-1} V_{j-1}``, waits for ``S_j`` only, takes its softmax while the tensor cores
  run the ``P V`` product, then waits for it and rescales ``O``.

    python docs/bench/speed/s48/gluon_fwd.py                     # GPU: check, then time
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s48/gluon_fwd.py \
        --compile                                                # CPU: sm_90 registers, spills
"""
import argparse
import math
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_init,
                                                              warpgroup_mma_wait)


@gluon.jit
def _kv_load(k_bufs, v_bufs, slot, kbase, vbase, off, row, n_rows, j_ar, D: gl.constexpr):
    """Key / value rows ``row ..`` (those below ``n_rows``) into ring slot ``slot``."""
    ok = (row + j_ar < n_rows)[:, None]
    step = row.to(gl.int64) * D
    cp.async_copy_global_to_shared(k_bufs.index(slot), kbase + step + off, mask=ok)
    cp.async_copy_global_to_shared(v_bufs.index(slot), vbase + step + off, mask=ok)
    cp.commit_group()


@gluon.jit
def _softmax(s, m_i, l_i, start, m0, qk_scale, offs_m, BN: gl.constexpr, SL: gl.constexpr):
    """The step's probabilities (float32, ``SL``), the new row max and sum, and ``alpha``."""
    s = s * qk_scale
    if start + BN > m0:  # a tile meeting the diagonal: the causal mask
        offs_n = start + gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _gluon_fwd(q, k, v, o, S, HQ, GROUP, qk_scale, BM: gl.constexpr, BN: gl.constexpr,
               D: gl.constexpr, NS: gl.constexpr, OVERLAP: gl.constexpr):
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                 instr_shape=[16, BN, 16])
    OL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                 instr_shape=[16, D, 16])
    POP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [8, 1], [1, 0])
    dt: gl.constexpr = q.dtype.element_ty
    mb = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    m0 = mb * BM
    qbase = q + bh.to(gl.int64) * S * D
    kvh = (b * (HQ // GROUP) + h // GROUP).to(gl.int64) * S * D
    kbase = k + kvh
    vbase = v + kvh
    # the query tile, once, into shared memory
    qr = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))[None, :]
    qs: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dt)
    q_smem = gl.allocate_shared_memory(dt, [BM, D], qs, gl.load(
        qbase + qr.to(gl.int64)[:, None] * D + cols, mask=(qr < S)[:, None], other=0.0))
    ks: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
    k_bufs = gl.allocate_shared_memory(dt, [NS, BN, D], ks)
    v_bufs = gl.allocate_shared_memory(dt, [NS, BN, D], ks)
    j_ar = gl.arange(0, BN, layout=gl.SliceLayout(1, LOAD))
    off = j_ar.to(gl.int64)[:, None] * D + cols
    hi = gl.minimum(m0 + BM, S)
    n = gl.cdiv(hi, BN)
    for i in gl.static_range(NS - 1):  # the ring's first tiles
        _kv_load(k_bufs, v_bufs, i, kbase, vbase, off, m0 * 0 + i * BN, hi, j_ar, D)
    offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SL))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, SL))
    zs = gl.zeros([BM, BN], gl.float32, layout=SL)
    acc = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, layout=OL))
    if OVERLAP:
        # step 0: its scores and probabilities, no product yet
        cp.wait_group(NS - 2)
        gl.thread_barrier()
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zs, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, 0, m0, qk_scale, offs_m, BN, SL)
        # the ring's last slot (free yet): step NS - 1's tiles
        _kv_load(k_bufs, v_bufs, NS - 1, kbase, vbase, off, m0 * 0 + (NS - 1) * BN, hi, j_ar, D)
        cur = 0
        for j in range(1, n):
            nxt = gl.where(cur == NS - 1, 0, cur + 1)
            cp.wait_group(NS - 2)  # step j's tiles are in
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zs, use_acc=False,
                              is_async=True)
            acc = warpgroup_mma(gl.convert_layout(p.to(dt), POP), v_bufs.index(cur), acc,
                                is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, j * BN, m0, qk_scale, offs_m, BN, SL)
            o_t = warpgroup_mma_wait(0, deps=(acc,))
            acc = warpgroup_mma_init(o_t * gl.convert_layout(alpha, gl.SliceLayout(1, OL))[:, None])
            # the slot step j - 1 used is free: step j + NS - 1's tiles into it
            gl.thread_barrier()
            _kv_load(k_bufs, v_bufs, cur, kbase, vbase, off, (j + NS - 1) * BN, hi, j_ar, D)
            cur = nxt
        acc = warpgroup_mma(gl.convert_layout(p.to(dt), POP), v_bufs.index(cur), acc,
                            is_async=True)
        o_t = warpgroup_mma_wait(0, deps=(acc,))
    else:
        cur = 0
        for j in range(n):
            cp.wait_group(NS - 2)
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_smem, k_bufs.index(cur).permute((1, 0)), zs, use_acc=False,
                              is_async=True)
            s, o_t = warpgroup_mma_wait(0, deps=(s, acc))
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, j * BN, m0, qk_scale, offs_m, BN, SL)
            o_t = o_t * gl.convert_layout(alpha, gl.SliceLayout(1, OL))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dt), POP), v_bufs.index(cur),
                                warpgroup_mma_init(o_t), is_async=True)
            # the slot step j - 1 used (its product waited for above) takes step j + NS - 1
            prev = gl.where(cur == 0, NS - 1, cur - 1)
            gl.thread_barrier()
            _kv_load(k_bufs, v_bufs, prev, kbase, vbase, off, (j + NS - 1) * BN, hi, j_ar, D)
            cur = gl.where(cur == NS - 1, 0, cur + 1)
        o_t = warpgroup_mma_wait(0, deps=(acc,))
    cp.wait_group(0)
    out = o_t / gl.convert_layout(l_i, gl.SliceLayout(1, OL))[:, None]
    om = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, OL))
    oc = gl.arange(0, D, layout=gl.SliceLayout(0, OL))[None, :]
    gl.store(o + bh.to(gl.int64) * S * D + om.to(gl.int64)[:, None] * D + oc, out.to(dt),
             mask=(om < S)[:, None])


VARIANTS = [dict(BN=bn, NS=ns, OVERLAP=ov) for bn, ns in ((128, 2), (64, 3), (64, 4))
            for ov in (0, 1)]


def name(var):
    return f"gluon BN{var['BN']} NS{var['NS']} overlap{var['OVERLAP']}"


def launch_args(q, k, o, var, BM=128):
    B, HQ, S, D = q.shape
    args = (q, k, k, o, S, HQ, HQ // k.shape[1], 1.0 / math.sqrt(D) * 1.4426950408889634)
    return (triton.cdiv(S, BM), B * HQ), args, dict(BM=BM, D=D, num_warps=8, **var)


def run(q, k, v, var):
    o = torch.empty_like(q)
    grid, args, kw = launch_args(q, k, o, var)
    args = (q, k, v) + args[3:]
    _gluon_fwd[grid](*args, **kw)
    return o


def compile_cpu(dims):
    from hf_hilbert_attn.tools import aot

    for D in dims:
        q = torch.empty(1, 4, 1024, D, dtype=torch.bfloat16)
        k = torch.empty(1, 1, 1024, D, dtype=torch.bfloat16)
        for var in VARIANTS:
            grid, args, kw = launch_args(q, k, q, var)
            try:
                row, kern = aot._compile(_gluon_fwd, args, kw, 90, True)
                loops = ""
                if "--loops" in sys.argv:
                    sys.path.insert(0, "docs/bench/speed/s44")
                    from gluon_compile_check import sass_loops
                    loops = " loops " + str(list(sass_loops(kern.asm["cubin"])))
                print(f"D{D} {name(var)}: registers {row['registers']} spills "
                      f"{row['spill_stores']}/{row['spill_loads']} shared {row['shared']}{loops}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"D{D} {name(var)}: FAILED {type(e).__name__}: {str(e)[-1500:]}",
                      flush=True)


def bench(seqs, hq, hkv, dims):
    from hf_hilbert_attn import DilatedPattern, dilated_attention

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for D in dims:
        for S in seqs:
            g = torch.Generator(device="cuda").manual_seed(S + D)
            q, k, v = (torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
                       for h in (hq, hkv, hkv))
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True) \
                if S <= 16384 else None
            fl = 4.0 * D * hq * S * (S + 1) / 2
            dense = DilatedPattern.dense(S)
            cases = [("ours (library, dense)", lambda: dilated_attention(q, k, v, dense,
                                                                           backend="triton")),
                     ("sdpa (auto)", lambda: torch.nn.functional.scaled_dot_product_attention(
                         q, k, v, is_causal=True, enable_gqa=True))]
            cases += [(name(var), (lambda var=var: run(q, k, v, var))) for var in VARIANTS]
            res = {}
            for label, fn in cases:
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item() if ref is not None \
                        else float("nan")
                    ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    print(f"D{D} S={S} {label}: FAILED {type(e).__name__}: {str(e)[-300:]}")
                    continue
                res[label] = ms
                print(f"D{D} S={S} {label:30s} {ms:8.3f} ms {fl / ms / 1e9:6.1f} TFLOP/s "
                      f"err {err:.2e}", flush=True)
            base = res.get("ours (library, dense)")
            if base:
                print(f"D{D} S={S} ÷ ours: " + ", ".join(f"{lb} {base / ms:.2f}"
                                                         for lb, ms in res.items()), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--loops", action="store_true", help="with --compile: SASS loop sizes")
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    a = ap.parse_args()
    if a.compile:
        compile_cpu(a.dims)
        sys.exit(0)
    bench(a.seq, a.hq, a.hkv, a.dims)
