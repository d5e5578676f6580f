"""Probe (issue 34): can a short sliding band's forward lose its fixed cost per program?

A 512-token window (query ``p`` sees keys ``p - 511 .. p``: `sliding_sparse`'s (512, 1) band,
68 % of its pairs) runs at 178 useful TFLOP/s in our library's forward at 64K where the dense
pattern runs at 501 (one H100, session 49). Fitted to the launches' times, a program costs ~1.1 µs
a key tile plus 10-13 µs of its own (query load, pipeline fill, merge, store, sink run): at 10
key tiles a program that fixed cost is half the launch. The Gluon dk/dv kernel, whose programs
loop over the 4 query heads of a key/value head, keeps 70 % of its long-band rate on this band
(the forward 49 %). Three plain Triton forwards of the band alone (no sink, no merge), side by
side with the library's forward of the same pattern (``patterns/band512.yaml``):

- ``head``: one program per 128 queries of one query head (the library's schedule), its key tiles
  in three loops (whole tiles unmasked, the window's edge and the diagonal masked);
- ``packed``: one program per 128 rows that are 32 positions of each query head of a key/value
  head: each key tile serves the group's heads at once, 9 key tiles a program (2 masked)
  against 10 (4 masked);
- ``persistent``: one program per SM walking (head, query tile) items in a flattened loop
  (``tl.range(..., flatten=True)``), so the compiler may load the next item's first key tiles
  while the last one's finish; every item takes the same 10 masked key tiles (Triton fuses an
  inner loop only if its bounds do not depend on the outer loop's index), and nothing tile-sized
  crosses from an item's start to its end but the accumulator (a carried tensor of 128 x 128
  row offsets spilled 2.7 KB a thread).

    python docs/bench/speed/s49/band_probe.py              # GPU: check each, then time them
    TRITON_INTERPRET=1 python docs/bench/speed/s49/band_probe.py --check   # CPU: outputs only
    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s49/band_probe.py \
        --compile   # CPU: compile each for sm_90 (registers, spills, SASS loop sizes)
"""
import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
BAND = os.path.join(HERE, "patterns", "band512.yaml")
LOG2E = 1.4426950408889634


@triton.jit
def _tiles(acc, l_i, m_i, qt, kp, vp, krow0, lo, n, qpos, S, W, qk_scale, BN: tl.constexpr,
           D: tl.constexpr, MASK: tl.constexpr, STAGES: tl.constexpr):
    """``n`` key tiles from key ``lo`` of one key/value head (rows from ``krow0`` of the flat
    ``[*, D]`` view; the trip count, not the keys, bounds the loop, so a loop around it may be
    flattened); ``MASK``: the window and causal mask and the sequence's ends."""
    offs_n = tl.arange(0, BN)
    offs = (offs_n.to(tl.int64) * D)[:, None] + tl.arange(0, D)[None, :]  # (the same each tile)
    for j in tl.range(0, n, num_stages=STAGES):
        kj = lo + j * BN + offs_n
        base = (krow0 + lo + j * BN).to(tl.int64) * D
        inside = (kj >= 0) & (kj < S)
        if MASK:
            k = tl.load(kp + base + offs, mask=inside[:, None], other=0.0)
        else:
            k = tl.load(kp + base + offs)
        s = tl.dot(qt, k.T) * qk_scale
        if MASK:
            ok = (kj[None, :] <= qpos[:, None]) & (kj[None, :] > qpos[:, None] - W) & \
                inside[None, :]
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if MASK else m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(vp + base + offs, mask=inside[:, None], other=0.0)
        else:
            v = tl.load(vp + base + offs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _band(qt, kp, vp, krow0, pa, pb, qpos, S, W, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
          D: tl.constexpr, STAGES: tl.constexpr):
    """The window's keys of query positions ``pa .. pb`` (rows ``qpos``): whole tiles first (every
    row has keys there, so no row's maximum is −∞ after them), then the window's edge and the
    diagonal, masked. Returns the output rows (float32)."""
    lo = tl.maximum(pa - W + 1, 0) // BN * BN
    full_lo = tl.maximum((tl.maximum(pb - W + 1, 0) + BN - 1) // BN * BN, lo)
    full_hi = tl.maximum((pa + 1) // BN * BN, full_lo)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, qt, kp, vp, krow0, full_lo, (full_hi - full_lo) // BN,
                           qpos, S, W, qk_scale, BN=BN, D=D, MASK=False, STAGES=STAGES)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, qt, kp, vp, krow0, lo, (full_lo - lo) // BN, qpos, S,
                           W, qk_scale, BN=BN, D=D, MASK=True, STAGES=STAGES)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, qt, kp, vp, krow0, full_hi,
                           (pb + 1 - full_hi + BN - 1) // BN, qpos, S, W, qk_scale, BN=BN, D=D,
                           MASK=True, STAGES=STAGES)
    return acc / l_i[:, None]


@triton.jit
def _head_fwd(q, k, v, o, S, HQ, GROUP, W, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
              D: tl.constexpr, STAGES: tl.constexpr):
    """Program ``(m, b * HQ + h)``: queries ``m * BM ..`` of query head ``h`` (last tiles first)."""
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    krow0 = (b * (HQ // GROUP) + h // GROUP) * S
    qpos = mb * BM + tl.arange(0, BM)
    rows = (bh * S + qpos).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    qt = tl.load(q + rows)
    out = _band(qt, k, v, krow0, mb * BM, mb * BM + BM - 1, qpos, S, W, qk_scale, BM=BM, BN=BN,
                D=D, STAGES=STAGES)
    tl.store(o + rows, out.to(qt.dtype))


@triton.jit
def _packed_fwd(q, k, v, o, S, HQ, W, qk_scale, GROUP: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
    """Program ``(m, b * Hkv + hk)``: rows ``r`` = position ``m * BM // GROUP + r // GROUP`` of
    query head ``hk * GROUP + r % GROUP`` (the group's heads side by side)."""
    NPOS: tl.constexpr = BM // GROUP
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    bk = tl.program_id(1)
    hkv = HQ // GROUP
    b, hk = bk // hkv, bk % hkv
    r = tl.arange(0, BM)
    qpos = mb * NPOS + r // GROUP
    qrow = (b * HQ + hk * GROUP + r % GROUP) * S + qpos
    rows = qrow.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    qt = tl.load(q + rows)
    out = _band(qt, k, v, bk * S, mb * NPOS, mb * NPOS + NPOS - 1, qpos, S, W, qk_scale, BM=BM,
                BN=BN, D=D, STAGES=STAGES)
    tl.store(o + rows, out.to(qt.dtype))


@triton.jit
def _persistent_fwd(q, k, v, o, S, HQ, GROUP, W, qk_scale, NT, TOTAL, NKT, BM: tl.constexpr,
                    BN: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
    """One program per SM: items ``t = pid, pid + P, ..`` of ``TOTAL`` = (batch, head, query
    tile) in one loop nest the compiler flattens (its inner loop's bounds may not depend on the
    item: every item takes the ``NKT`` key tiles ending at its diagonal, those before the
    sequence's start masked); every tile masked."""
    offs_d = tl.arange(0, D)
    offs_m = (tl.arange(0, BM) * D)[:, None] + offs_d[None, :]
    for t in tl.range(tl.program_id(0), TOTAL, tl.num_programs(0), flatten=True):
        bh = t // NT
        mb = NT - 1 - t % NT
        b, h = bh // HQ, bh % HQ
        qpos = mb * BM + tl.arange(0, BM)
        row0 = (bh * S + mb * BM).to(tl.int64) * D  # (a number: the store rebuilds the rows'
        qt = tl.load(q + row0 + offs_m)            # offsets, so no tensor of them is carried)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        acc, l_i, m_i = _tiles(acc, l_i, m_i, qt, k, v, (b * (HQ // GROUP) + h // GROUP) * S,
                               mb * BM + BM - NKT * BN, NKT, qpos, S, W, qk_scale, BN=BN, D=D,
                               MASK=True, STAGES=STAGES)
        tl.store(o + row0 + offs_m, (acc / l_i[:, None]).to(qt.dtype))


VARIANTS = ("head", "packed", "persistent")


def launch(name, q, k, v, o, window, BM=128, BN=64, stages=3, warps=8, sms=None):
    """``(kernel, grid, args, kwargs)`` of variant ``name`` on ``q k v o`` ``[B, H, S, D]``
    (contiguous; S a multiple of 128)."""
    B, HQ, S, D = q.shape
    group = HQ // k.shape[1]
    scale = 1.0 / math.sqrt(D) * LOG2E
    kw = dict(BM=BM, BN=BN, D=D, STAGES=stages, num_warps=warps, num_stages=stages)
    if name == "head":
        return _head_fwd, (S // BM, B * HQ), (q, k, v, o, S, HQ, group, window, scale), kw
    if name == "packed":
        return (_packed_fwd, (S // (BM // group), B * k.shape[1]),
                (q, k, v, o, S, HQ, window, scale), dict(kw, GROUP=group))
    total = B * HQ * (S // BM)
    grid = (min(total, sms or 132),)
    nkt = -(-(window + BM - 1) // BN)  # key tiles reaching a query tile's window
    return (_persistent_fwd, grid, (q, k, v, o, S, HQ, group, window, scale, S // BM, total,
                                    nkt), kw)


def run(name, q, k, v, window, **tiles):
    o = torch.empty_like(q)
    fn, grid, args, kw = launch(name, q, k, v, o, window, **tiles)
    fn[grid](*args, **kw)
    return o


def band_reference(q, k, v, window):
    """Float32 dense attention with the band mask (``p - window < j <= p``)."""
    S = q.shape[2]
    pos = torch.arange(S, device=q.device)
    ok = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    kf, vf = (t.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ vf


def check_cpu():
    """Interpreter: every variant against the float32 reference on small tiles (16 x 16: the
    window's edge, whole tiles and the diagonal all occur)."""
    torch.manual_seed(0)
    S, D, window = 160, 16, 40
    q, k, v = (torch.randn(1, h, S, D) for h in (4, 2, 2))
    ref = band_reference(q, k, v, window)
    for name in VARIANTS:
        out = run(name, q, k, v, window, BM=16, BN=16, stages=1, warps=1, sms=3)
        print(f"{name}: max error {(out - ref).abs().max().item():.2e}")


def compile_cpu():
    sys.path[:0] = [os.path.join(HERE, "..", "s44")]
    from gluon_compile_check import sass_loop_bodies

    from hf_hilbert_attn.tools import aot

    q = torch.empty(1, 4, 1024, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 1, 1024, 128, dtype=torch.bfloat16)
    for name in VARIANTS:
        fn, grid, args, kw = launch(name, q, k, k, q, 512)
        try:
            row, kern = aot._compile(fn, args, kw, 90, True)
            loops = [len(body) for body in sass_loop_bodies(kern.asm["cubin"])]
            print(f"{name}: registers {row['registers']} spills {row['spill_stores']}/"
                  f"{row['spill_loads']} shared {row['shared']} loops {loops} "
                  f"({row['compile_s']} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[-400:]}", flush=True)


def bench(seqs, hq, hkv, D=128, window=512):
    from hf_hilbert_attn import dilated_attention
    from hf_hilbert_attn.patterns import as_pattern

    band = as_pattern(BAND)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for S in seqs:
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (hq, hkv, hkv))
        ref = band_reference(q[:, :, :4096], k[:, :, :4096], v[:, :, :4096], window)
        pairs = hq * sum(min(p + 1, window) for p in range(S))
        cases = [("ours (library, band512)", lambda: dilated_attention(q, k, v, band,
                                                                     backend="triton"))]
        cases += [(n, (lambda n=n: run(n, q, k, v, window, sms=sms))) for n in VARIANTS]
        res = {}
        for label, fn in cases:
            try:
                out = fn()
                err = ((out[:, :, :4096].float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(fn, warmup=30, rep=200)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                print(f"S={S} {label}: FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)
                continue
            res[label] = ms
            print(f"S={S} {label:24s} {ms:7.3f} ms {4 * D * pairs / ms / 1e9:6.1f} TFLOP/s "
                  f"err {err:.2e}", flush=True)
        base = res.get("ours (library, band512)")
        if base:
            print(f"S={S} ÷ ours: " + ", ".join(f"{lb} {base / ms:.2f}" for lb, ms in res.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="outputs only (Triton's interpreter)")
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    a = ap.parse_args()
    if a.check:
        check_cpu()
    elif a.compile:
        compile_cpu()
    else:
        bench(a.seq, a.hq, a.hkv)
