"""Probe (issue 34): how fast can a plain causal forward written in Triton 3.6 go on an H100, and
which of its features pays — tensor-memory (TMA) descriptors for the key / value tiles, and the
compiler's warp specialization (``tl.range(..., warp_specialize=True)``, on Hopper since Triton
3.4)? Our forward kernel (pointer loads, software pipelining) ran dense causal at 461 useful
TFLOP/s at 64K (D 128, 32 / 8 heads), SDPA's cuDNN at 625 in the same run (s47, call 3). If a
variant here beats ours by a wide margin on the same shape, its feature is worth bringing to the
library's forward (its band loop is this loop with masks).

    python docs/bench/speed/s48/fwd_probe.py                # GPU: check, then time every variant
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s48/fwd_probe.py \
        --compile   # CPU: compile each variant for sm_90 (registers, spills), no GPU

Variants ``ptr|tma`` × key tile ``BN`` (64, 128), 128 queries a program, 8 warps.
Prints per shape: ms, useful TFLOP/s (causal pairs × 4 D), and ÷ our library's dense forward and
SDPA (its own pick) on the same tensors; errors against SDPA in float32.
"""
import argparse
import itertools
import math
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _band(acc, l_i, m_i, q, kd, vd, kp, vp, row0, lo, hi, offs_m, qk_scale,
          BN: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
          WS: tl.constexpr, STAGES: tl.constexpr):
    """Key tiles ``[lo, hi)`` of one key/value head (its rows start at ``row0`` of the flat
    ``[B * Hkv * S, D]`` view); ``MASK``: the causal mask (diagonal tiles)."""
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    for start in tl.range(lo, hi, BN, num_stages=STAGES, warp_specialize=WS):
        if TMA:
            k = kd.load([row0 + start, 0])
        else:
            k = tl.load(kp + (row0 + start + offs_n).to(tl.int64)[:, None] * D + offs_d[None, :])
        s = tl.dot(q, k.T) * qk_scale
        if MASK:
            s = tl.where(offs_m[:, None] >= start + offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = vd.load([row0 + start, 0])
        else:
            v = tl.load(vp + (row0 + start + offs_n).to(tl.int64)[:, None] * D + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _probe_fwd(qd, kd, vd, od, q, k, v, o, S, HQ, GROUP, qk_scale, BM: tl.constexpr,
               BN: tl.constexpr, D: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
               STAGES: tl.constexpr):
    """Program ``(m, b * HQ + h)``: queries ``[m * BM, m * BM + BM)`` (the last tiles first) of
    query head ``h``, causal, against key/value head ``h // GROUP``."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    qrow0 = bh * S
    krow0 = (b * (HQ // GROUP) + h // GROUP) * S
    offs_m = mb * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    if TMA:
        qt = qd.load([qrow0 + mb * BM, 0])
    else:
        qt = tl.load(q + (qrow0 + offs_m).to(tl.int64)[:, None] * D + offs_d[None, :])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    # whole tiles below the diagonal, then the diagonal's tiles with the mask
    acc, l_i, m_i = _band(acc, l_i, m_i, qt, kd, vd, k, v, krow0, 0, mb * BM, offs_m, qk_scale,
                          BN=BN, D=D, MASK=False, TMA=TMA, WS=WS, STAGES=STAGES)
    acc, l_i, m_i = _band(acc, l_i, m_i, qt, kd, vd, k, v, krow0, mb * BM, mb * BM + BM, offs_m,
                          qk_scale, BN=BN, D=D, MASK=True, TMA=TMA, WS=WS, STAGES=STAGES)
    out = (acc / l_i[:, None]).to(qt.dtype)
    if TMA:
        od.store([qrow0 + mb * BM, 0], out)
    else:
        tl.store(o + (qrow0 + offs_m).to(tl.int64)[:, None] * D + offs_d[None, :], out)


# Warp specialization is left out: compiled for sm_90 on the CPU (Triton 3.6), with 8 warps the
# loops are left as they are (no warp_specialize op in the TTGIR, the same registers), with 4 the
# compiler's NVGPUWarpSpecialization pass fails (an MLIR dominance assertion).
VARIANTS = [dict(TMA=t, WS=0, BN=bn) for t, bn in itertools.product((0, 1), (64, 128))]


def name(var):
    return f"{'tma' if var['TMA'] else 'ptr'} ws{var['WS']} BN{var['BN']}"


def launch_args(q, k, v, o, var, BM=128):
    """``(grid, args, kwargs)`` of the probe on ``q k v o`` ``[B, H, S, D]`` (contiguous; S a
    multiple of 128)."""
    B, HQ, S, D = q.shape
    BN = var["BN"]
    flat = [t.view(-1, D) for t in (q, k, v, o)]
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [bs, D])
             for t, bs in zip(flat, (BM, BN, BN, BM))]
    args = (*descs, *flat, S, HQ, HQ // k.shape[1], 1.0 / math.sqrt(D) * 1.4426950408889634)
    kw = dict(BM=BM, BN=BN, D=D, TMA=var["TMA"], WS=var["WS"], STAGES=3, num_warps=8,
              num_stages=3)
    return (S // BM, B * HQ), args, kw


def run(q, k, v, var):
    o = torch.empty_like(q)
    grid, args, kw = launch_args(q, k, v, o, var)
    _probe_fwd[grid](*args, **kw)
    return o


def compile_cpu():
    from hf_hilbert_attn.tools import aot

    for D in (128, 64):
        q = torch.empty(1, 4, 1024, D, dtype=torch.bfloat16)
        k = torch.empty(1, 1, 1024, D, dtype=torch.bfloat16)
        for var in VARIANTS:
            grid, args, kw = launch_args(q, k, k, q, var)
            try:
                row = aot.compile_launch(_probe_fwd, args, kw, arch=90)
                print(f"D{D} {name(var)}: registers {row['registers']} spills "
                      f"{row['spill_stores']}/{row['spill_loads']} shared {row['shared']} "
                      f"({row['compile_s']} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"D{D} {name(var)}: FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)


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
            res = {}
            dense = DilatedPattern.dense(S)
            cases = [("ours (library, dense)", lambda: dilated_attention(q, k, v, dense,
                                                                           backend="triton")),
                     ("sdpa (auto)", lambda: torch.nn.functional.scaled_dot_product_attention(
                         q, k, v, is_causal=True, enable_gqa=True))]
            cases += [(name(var), (lambda var=var: run(q, k, v, var))) for var in VARIANTS]
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
                print(f"D{D} S={S} {label:24s} {ms:8.3f} ms {fl / ms / 1e9:6.1f} TFLOP/s "
                      f"err {err:.2e}", flush=True)
            base = res.get("ours (library, dense)")
            if base:
                print(f"D{D} S={S} ÷ ours: " + ", ".join(f"{lb} {base / ms:.2f}"
                                                         for lb, ms in res.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    a = ap.parse_args()
    if a.compile:
        compile_cpu()
        sys.exit(0)
    bench(a.seq, a.hq, a.hkv, a.dims)
