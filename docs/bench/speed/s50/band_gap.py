"""Where does our library's forward of a 512-token band lose 11-16 % to a plain Triton kernel of
the same schedule (session 50, call 1: ``band_probe.py``, one H100: library 2.25 ms, plain
``head`` 2.03 ms at 64K)? Their key loops compile alike for sm_90 (SASS instructions per loop:
library 387 / 592 / 600, plain 367 / 588 / 586); what differs is around them. Variants of the
plain ``head`` kernel (``band_probe._head_fwd``'s schedule), each adding one thing the library
does, side by side with the library in one run:

- ``row``: the launch's integers (sequence length, heads, group, window) read from a device row
  before anything else, as the library reads its launch row (``_launch_scalars``): one more
  memory round trip before the query tile's load;
- ``lse``: query rows masked (``row_ok``) on load and store, and the log-sum-exp stored;
- ``stages1``: the masked (edge, diagonal) loops of two tiles each without software pipelining
  (``num_stages=1``): a 3-stage pipeline's fill on a 2-trip loop may cost more than it hides;
- ``edge_first``: the window's edge loop before the whole tiles, as the library orders them;
- ``ascending``: programs in ascending query-tile order, as the library launches them;
- ``row+lse``: both of the first two.

    python docs/bench/speed/s50/band_gap.py                    # GPU: check each, time them
    TRITON_INTERPRET=1 python docs/bench/speed/s50/band_gap.py --check   # CPU: outputs only
"""
import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "s49"))
import band_probe as P  # noqa: E402


@triton.jit
def _gap_fwd(q, k, v, o, lse, ints, S_, HQ_, GROUP_, W_, qk_scale, BM: tl.constexpr,
             BN: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr, EDGE_STAGES: tl.constexpr,
             ROW: tl.constexpr, LSE: tl.constexpr, EDGE_FIRST: tl.constexpr,
             ASC: tl.constexpr):
    """``band_probe._head_fwd`` with the switches of the module's docstring."""
    if ROW:
        S, HQ, GROUP, W = tl.load(ints), tl.load(ints + 1), tl.load(ints + 2), tl.load(ints + 3)
    else:
        S, HQ, GROUP, W = S_, HQ_, GROUP_, W_
    mb = tl.program_id(0) if ASC else tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    krow0 = (b * (HQ // GROUP) + h // GROUP) * S
    qpos = mb * BM + tl.arange(0, BM)
    rows = (bh * S + qpos).to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    if LSE:
        row_ok = qpos < S
        qt = tl.load(q + rows, mask=row_ok[:, None], other=0.0)
    else:
        qt = tl.load(q + rows)
    pa, pb = mb * BM, mb * BM + BM - 1
    lo = tl.maximum(pa - W + 1, 0) // BN * BN
    full_lo = tl.maximum((tl.maximum(pb - W + 1, 0) + BN - 1) // BN * BN, lo)
    full_hi = tl.maximum((pa + 1) // BN * BN, full_lo)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if EDGE_FIRST:
        acc, l_i, m_i = P._tiles(acc, l_i, m_i, qt, k, v, krow0, lo, (full_lo - lo) // BN, qpos,
                                 S, W, qk_scale, BN=BN, D=D, MASK=True, STAGES=EDGE_STAGES)
    acc, l_i, m_i = P._tiles(acc, l_i, m_i, qt, k, v, krow0, full_lo, (full_hi - full_lo) // BN,
                             qpos, S, W, qk_scale, BN=BN, D=D, MASK=False, STAGES=STAGES)
    if not EDGE_FIRST:
        acc, l_i, m_i = P._tiles(acc, l_i, m_i, qt, k, v, krow0, lo, (full_lo - lo) // BN, qpos,
                                 S, W, qk_scale, BN=BN, D=D, MASK=True, STAGES=EDGE_STAGES)
    acc, l_i, m_i = P._tiles(acc, l_i, m_i, qt, k, v, krow0, full_hi,
                             (pb + 1 - full_hi + BN - 1) // BN, qpos, S, W, qk_scale, BN=BN, D=D,
                             MASK=True, STAGES=EDGE_STAGES)
    out = (acc / l_i[:, None]).to(qt.dtype)
    if LSE:
        tl.store(lse + bh.to(tl.int64) * S + qpos, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
                 mask=row_ok)
        tl.store(o + rows, out, mask=row_ok[:, None])
    else:
        tl.store(o + rows, out)


VARIANTS = {"head": {}, "row": dict(ROW=True), "lse": dict(LSE=True),
            "stages1": dict(EDGE_STAGES=1), "edge_first": dict(EDGE_FIRST=True),
            "ascending": dict(ASC=True), "row+lse": dict(ROW=True, LSE=True)}


def run(name, q, k, v, window, BM=128, BN=64, stages=3, warps=8):
    B, HQ, S, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, HQ, S, device=q.device, dtype=torch.float32)
    ints = torch.tensor([S, HQ, HQ // k.shape[1], window], device=q.device, dtype=torch.int32)
    flags = dict(ROW=False, LSE=False, EDGE_STAGES=stages, EDGE_FIRST=False, ASC=False) \
        | VARIANTS[name]
    _gap_fwd[(S // BM, B * HQ)](q, k, v, o, lse, ints, S, HQ, HQ // k.shape[1], window,
                                1.0 / math.sqrt(D) * P.LOG2E, BM=BM, BN=BN, D=D, STAGES=stages,
                                num_warps=warps, num_stages=stages, **flags)
    return o


def check_cpu():
    torch.manual_seed(0)
    S, D, window = 160, 16, 40
    q, k, v = (torch.randn(1, h, S, D) for h in (4, 2, 2))
    ref = P.band_reference(q, k, v, window)
    for name in VARIANTS:
        out = run(name, q, k, v, window, BM=16, BN=16, stages=1, warps=1)
        print(f"{name}: max error {(out - ref).abs().max().item():.2e}")


def bench(seqs, hq, hkv, D=128, window=512, rounds=3):
    from hf_hilbert_attn import dilated_attention
    from hf_hilbert_attn.patterns import as_pattern

    band = as_pattern(P.BAND)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for S in seqs:
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for h in (hq, hkv, hkv))
        ref = P.band_reference(q[:, :, :4096], k[:, :, :4096], v[:, :, :4096], window)
        pairs = hq * sum(min(p + 1, window) for p in range(S))
        cases = [("ours (library, band512)",
                  lambda: dilated_attention(q, k, v, band, backend="triton"))]
        cases += [(n, (lambda n=n: run(n, q, k, v, window))) for n in VARIANTS]
        res = {label: [] for label, _ in cases}
        for label, fn in cases:
            out = fn()
            err = ((out[:, :, :4096].float() - ref).norm() / ref.norm()).item()
            print(f"S={S} {label}: err {err:.2e}", flush=True)
        for _ in range(rounds):  # rounds interleaved: the card's clock drifts alike for all
            for label, fn in cases:
                res[label].append(triton.testing.do_bench(fn, warmup=20, rep=150))
        for label, ms in res.items():
            m = min(ms)
            print(f"S={S} {label:24s} {m:7.3f} ms {4 * D * pairs / m / 1e9:6.1f} TFLOP/s "
                  f"(rounds {', '.join(f'{x:.3f}' for x in ms)})", flush=True)
        base = min(res["head"])
        print(f"S={S} ÷ head (time): " + ", ".join(f"{lb} {min(ms) / base:.3f}"
                                                   for lb, ms in res.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="outputs only (Triton's interpreter)")
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    a = ap.parse_args()
    if a.check:
        check_cpu()
    else:
        bench(a.seq, 32, 8)
