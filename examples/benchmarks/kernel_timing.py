"""Quick check + timing of the Triton dilated-attention kernels (one device call).

    python examples/benchmarks/kernel_timing.py --seq 65536 --hq 32 --hkv 8 --dim 128
    python examples/benchmarks/kernel_timing.py --no-check --seq 65536 \
        --pattern longnet_lm sliding_sparse my_pattern.yaml --csv timing.csv
    python examples/benchmarks/kernel_timing.py --device cpu --no-check --seq 256 --hq 4 \
        --hkv 2 --dim 16 --pattern configs/patterns/default_kv0_dense.yaml --rep-ms 1  # smoke

Prints, per case: max error vs a float32 reference on a small shape, then fwd / fwd+bwd ms
(median of do_bench), useful TFLOP/s (allowed pairs only, ``pattern.attention_flops``; a
pattern's dense key/value heads counted with ``--hkv``) and peak memory, next to SDPA flash
dense causal on the same shape. ``--dense`` adds our kernels on the dense pattern (the yardstick
of the sparse ones: each pattern's TFLOP/s over it, printed as ``÷ our dense kernel``) and SDPA
as it picks a backend for that call (cuDNN on an H100 / H200: not our kernel);
``--profile`` a per-config, per-kernel table of each pattern; ``--softcap CAP`` each pattern
again with soft-capped scores (Gemma 2). ``--device cpu`` runs the same
rows on the PyTorch path (wall clock, SDPA's own CPU kernel, no memory column): a smoke run of
the pipeline, its timings mean nothing.
"""

import argparse
import csv
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.benchmarks import common as C

DEVICE = torch.device("cuda")  # main() sets it from --device
REP_MS = 300.0  # main() sets it from --rep-ms


def _bench(fn, grad_to_none=None, warmup=50, rep=None):
    """Median ms of ``fn()``: ``triton.testing.do_bench`` on CUDA, the wall clock on CPU."""
    rep = REP_MS if rep is None else rep
    if DEVICE.type == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median",
                                       grad_to_none=grad_to_none)
    return C.bench_ms(fn, DEVICE, warmup_ms=warmup, rep_ms=rep, grad_to_none=grad_to_none,
                      min_reps=1)


def _reset_peak():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _with_peak(res):
    """``res`` with ``peak_gib`` (CUDA; CPU memory is not tracked: no column)."""
    if DEVICE.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def _flash():
    """SDPA's flash backend on CUDA (the dense baseline); SDPA's own choice elsewhere."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if DEVICE.type == "cuda" else nullcontext()


def _rel(a, b):
    # relative Frobenius error; absolute where the reference is exactly zero
    ref = b.float().norm()
    err = (a.float() - b.float()).norm()
    return (err / ref if ref > 0 else err).item()


def check(pattern, s=2048, hq=8, hkv=2, d=128, dtype=torch.bfloat16, causal=True, sq=None):
    sq = sq or s
    q = torch.randn(1, hq, sq, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    o = dilated_attention(q, k, v, pattern, causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    g = [t.grad for t in (q, k, v)]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ro = reference_attention(qf, kf, vf, pattern, causal=causal)
    ro.backward(do.float())
    errs = [_rel(o, ro)] + [_rel(a, b.grad) for a, b in zip(g, (qf, kf, vf))]
    return errs


def time_case(pattern, s, hq, hkv, d, dtype, causal=True, bwd=True, hilbert=False,
              backend="auto", softcap=None):
    q = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype, requires_grad=bwd)
    k = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=bwd)
    v = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=bwd)
    kw = dict(backend=backend, **({"softcap": softcap} if softcap else {}))  # (older packages)
    if hilbert:
        kw["k_positions"] = torch.randperm(s, device=DEVICE)
    fl = pattern.attention_flops(s, hq, d, causal=causal, num_kv_heads=hkv)
    _reset_peak()
    with torch.no_grad():
        t_f = _bench(lambda: dilated_attention(q, k, v, pattern, causal=causal, **kw))
    res = dict(fwd_ms=t_f, fwd_tflops=fl / t_f / 1e9)
    if bwd:
        do = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype)

        def fb():
            o = dilated_attention(q, k, v, pattern, causal=causal, **kw)
            o.backward(do)

        t_fb = _bench(fb, grad_to_none=[q, k, v])
        res.update(fb_ms=t_fb, fb_tflops=fl * 3.5 / t_fb / 1e9)
    return _with_peak(res)


def time_sdpa(s, hq, hkv, d, dtype):
    q = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(1, hkv, s, d, device=DEVICE, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    _reset_peak()
    with _flash():
        def fb():
            kk = k.repeat_interleave(hq // hkv, 1)
            vv = v.repeat_interleave(hq // hkv, 1)
            F.scaled_dot_product_attention(q, kk, vv, is_causal=True).backward(do)
        t = _bench(fb, grad_to_none=[q, k, v])
    fl = 4.0 * d * hq * s * (s + 1) / 2 * 3.5
    return _with_peak(dict(fb_ms=t, fb_tflops=fl / t / 1e9))


def time_sdpa_fwd(s, hq, hkv, d, dtype):
    q = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype)
    k = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype)
    v = torch.randn(1, hq, s, d, device=DEVICE, dtype=dtype)
    with _flash():
        t = _bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   rep=min(REP_MS, 200.0))
    return dict(fwd_ms=t, fwd_tflops=4.0 * d * hq * s * (s + 1) / 2 / t / 1e9)


def density(pattern, s, hq, hkv):
    """Allowed causal pairs / dense causal pairs over ``hq`` query heads (a query head of a
    dense key/value head, ``hkv`` heads, counts every pair)."""
    return pattern.count_pairs_total(s, hq, num_kv_heads=hkv) / (hq * s * (s + 1) / 2)


def launch_pairs(pattern, s, hq, hkv=None):
    """``[((w, r), pairs)]`` in the kernels' launch order: the pairs each launch computes under
    the union rule (a config keeps the pairs no config before it in priority allows), summed
    over heads; the last launch also runs the sink-key pairs no config allows. A pattern with
    dense key/value heads (``hkv`` needed then): the sparse part's launches, summed over the
    other heads (the dense heads' slice runs in launches of its own, not listed)."""
    from hf_hilbert_attn.kernels._plan import config_order

    keep = (~pattern.dense_query_heads(hq, hkv)).tolist()
    sparse = pattern.sparse_part
    prio, launch = config_order(sparse)

    def pairs(p):  # over the sparse heads
        return sum(n for n, k in zip(p.count_pairs(s, hq), keep) if k)

    def upto(k):  # pairs of the first k priority configs, no sinks
        if k == 0:
            return 0
        ws, rs = zip(*prio[:k])
        return pairs(DilatedPattern(list(ws), list(rs), query_dilation=sparse.query_dilation,
                                    window=sparse.window))

    cum = [upto(k) for k in range(len(prio) + 1)]
    own = {cfg: cum[i + 1] - cum[i] for i, cfg in enumerate(prio)}
    own[launch[-1]] += pairs(sparse) - cum[-1]  # the sink keys
    return [(cfg, own[cfg]) for cfg in launch]


def launch_table(pattern, s, hq, d, events, hkv=None):
    """Per launch: config, share of the pairs, forward / dq / dk/dv ms and useful TFLOP/s, from
    ``events`` ``[(kernel name, ms)]`` in order (None when the launches are not one per
    config, e.g. split into head chunks, or with dense heads, whose slice adds launches)."""
    pairs = launch_pairs(pattern, s, hq, hkv)
    by = {k: [ms for name, ms in events if name.startswith(k)] for k in ("_fwd", "_dq", "_dkdv")}
    if any(len(v) != len(pairs) for v in by.values()):
        return None
    total = sum(n for _, n in pairs)
    rows = ["| config | pairs | fwd ms (TFLOP/s) | dq ms | dk/dv ms | bwd TFLOP/s |",
            "|---|---|---|---|---|---|"]
    for i, ((w, r), n) in enumerate(pairs):
        f, q, kv = by["_fwd"][i], by["_dq"][i], by["_dkdv"][i]
        rows.append(f"| ({w}, {r}) | {n / total:.1%} | {f:.2f} ({4 * d * n / f / 1e9:.0f}) | "
                    f"{q:.2f} | {kv:.2f} | {10 * d * n / (q + kv) / 1e9:.0f} |")
    return "\n".join(rows)


def profile(name, pattern, s, hq, hkv, d):
    q = torch.randn(1, hq, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, hkv, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, hkv, s, d, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        dilated_attention(q, k, v, pattern).backward(torch.ones_like(q))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dilated_attention(q, k, v, pattern).backward(torch.ones_like(q))
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"profile {name} S={s}: " + ", ".join(f"{e.name[:12]}={e.device_time / 1e3:.2f}ms" for e in evs))
    table = launch_table(pattern, s, hq, d, [(e.name, e.device_time / 1e3) for e in evs], hkv)
    if table:
        print(table)


def long_runs(pattern, s_fb, s_fwd, hq, hkv, d):
    for s, grad in ((s_fb, True), (s_fwd, False)):
        h, hk, dd, dt = (hq, hkv, d, torch.bfloat16) if grad else (8, 8, 64, torch.float16)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        q = torch.randn(1, h, s, dd, device="cuda", dtype=dt, requires_grad=grad)
        k = torch.randn(1, hk, s, dd, device="cuda", dtype=dt, requires_grad=grad)
        v = torch.randn(1, hk, s, dd, device="cuda", dtype=dt, requires_grad=grad)
        torch.cuda.synchronize()
        t = time.time()
        with torch.set_grad_enabled(grad):
            o = dilated_attention(q, k, v, pattern)
            if grad:
                o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30  # before the checks' temporaries
        ok = all(bool(torch.isfinite(c).all()) for c in o.split(1 << 20, dim=2))
        print(f"long S={s} {'fwd+bwd' if grad else 'fwd'} H={h}/{hk} D={dd} {dt}: "
              f"{time.time() - t:.2f}s (incl. compile) peak {peak:.1f} GiB finite={ok}")
        del q, k, v, o


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[65536])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--pattern", nargs="+", default=["longnet_lm"],
                    help="shipped pattern names or YAML files, timed side by side (the first is used for "
                         "--long, --decode)")
    ap.add_argument("--csv", default=None, help="also write the timing rows to this CSV")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--hilbert", action="store_true", help="also time a random position map")
    ap.add_argument("--softcap", type=float, default=None,
                    help="also time each pattern with its scores soft-capped at this value")
    ap.add_argument("--profile", action="store_true",
                    help="per-launch kernel times of one fwd+bwd of each pattern")
    ap.add_argument("--dense", action="store_true", help="also time the dense pattern (raw speed)")
    ap.add_argument("--decode", action="store_true", help="time Sq=1 against the torch path")
    ap.add_argument("--long", type=int, nargs=2, metavar=("S_FB", "S_FWD"), default=None,
                    help="one fwd+bwd at S_FB (Hq, Hkv, D of the args) and one forward at S_FWD "
                         "(8 heads x 64, fp16, no grad): time and peak memory")
    ap.add_argument("--device", default="cuda",
                    help="cuda (default) or cpu: the PyTorch path, a smoke run (timings mean "
                         "nothing; no --profile, --long)")
    ap.add_argument("--rep-ms", type=float, default=300.0,
                    help="timing budget per measurement in ms (do_bench's rep; default 300)")
    args = ap.parse_args(argv)
    global DEVICE, REP_MS
    DEVICE, REP_MS = torch.device(args.device), args.rep_ms
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu runs the PyTorch path (a smoke run)")
    if DEVICE.type != "cuda" and (args.profile or args.long):
        ap.error("--profile and --long time GPU kernels: they need --device cuda")
    if args.hkv < 1 or args.hq % args.hkv:
        ap.error(f"--hq ({args.hq}) must be a multiple of --hkv ({args.hkv})")
    pats = [(Path(p).stem, as_pattern(p)) for p in args.pattern]
    for name, p in pats:  # dense key/value heads must exist at --hkv (counting needs it)
        try:
            p.check_kv_heads(args.hkv)
        except ValueError as e:
            ap.error(f"pattern {name}: {e}")
    pat = pats[0][1]
    gpu = C.device_name(DEVICE)
    print(gpu, "torch", torch.__version__, "triton", triton.__version__)
    rows = []
    if not args.no_check:
        small = DilatedPattern([256, 512, 1024], [1, 2, 4])
        for p, causal, sq in [(small, True, None), (small, False, None),
                              (small.replace(query_dilation="all"), True, None),
                              (DilatedPattern([300, 700], [1, 3]), True, None), (small, True, 1)]:
            t = time.time()
            # decode: the last query of 2100 keys (at 2048 a query would see only itself,
            # where dq = dk = 0 and a relative error is meaningless)
            e = check(p, s=2049 if sq is None else 2100, causal=causal, sq=sq)
            print(f"check {p} causal={causal} sq={sq}: rel err out/dq/dk/dv "
                  + " ".join(f"{x:.2e}" for x in e) + f" ({time.time() - t:.1f}s)")
    if args.decode:
        for s in args.seq:
            q = torch.randn(1, args.hq, 1, args.dim, device=DEVICE, dtype=torch.bfloat16)
            k = torch.randn(1, args.hkv, s, args.dim, device=DEVICE, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            for be in ("triton", "torch") if DEVICE.type == "cuda" else ("torch",):
                t = _bench(lambda: dilated_attention(q, k, v, pat, backend=be), warmup=20,
                           rep=min(REP_MS, 100.0))
                print(f"decode Sk={s} backend={be}: {t * 1e3:.0f} us")
    if args.long:
        long_runs(pat, *args.long, args.hq, args.hkv, args.dim)
        return
    for s in args.seq:
        for name, p in pats if args.profile else ():
            profile(name, p, s, args.hq, args.hkv, args.dim)
        if args.dense:
            # our kernels on the dense pattern (backend "auto" would hand it to SDPA, D32), and
            # that SDPA call (GQA in place: cuDNN or flash, as SDPA picks)
            dense = DilatedPattern.dense(s)
            be = "triton" if DEVICE.type == "cuda" else "torch"
            ours_dense = r = time_case(dense, s, args.hq, args.hkv, args.dim, torch.bfloat16,
                                       backend=be)
            print(f"ours dense   S={s}: " + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
            rows.append(dict(gpu=gpu, impl="ours", pattern="dense", seq=s, density=1.0, **r))
            r = time_case(dense, s, args.hq, args.hkv, args.dim, torch.bfloat16)
            print(f"sdpa dense (auto: SDPA's pick, not ours) S={s}: "
                  + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
            rows.append(dict(gpu=gpu, impl="sdpa (auto, dense causal)", pattern="dense", seq=s,
                             density=1.0, **r))
            r = time_sdpa_fwd(s, args.hq, args.hkv, args.dim, torch.bfloat16)
            print(f"sdpa fwd     S={s}: " + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
        for name, p in pats:
            dens = density(p, s, args.hq, args.hkv)
            r = time_case(p, s, args.hq, args.hkv, args.dim, torch.bfloat16)
            print(f"ours {name} S={s} (density {dens:.2%}): "
                  + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
            rows.append(dict(gpu=gpu, impl="ours", pattern=name, seq=s, density=dens, **r))
            if args.softcap:
                r = time_case(p, s, args.hq, args.hkv, args.dim, torch.bfloat16,
                              softcap=args.softcap)
                print(f"ours softcap {name} S={s}: "
                      + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
                rows.append(dict(gpu=gpu, impl=f"ours softcap {args.softcap:g}", pattern=name,
                                 seq=s, density=dens, **r))
            if args.hilbert:
                r = time_case(p, s, args.hq, args.hkv, args.dim, torch.bfloat16, hilbert=True)
                print(f"ours mapped {name} S={s}: " + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
                rows.append(dict(gpu=gpu, impl="ours mapped", pattern=name, seq=s, density=dens, **r))
        if args.dense:  # each pattern's useful TFLOP/s over our dense kernel's (the yardstick)
            print(f"÷ our dense kernel S={s}, fwd / fwd+bwd: " + ", ".join(
                f"{r['pattern']} {r['fwd_tflops'] / ours_dense['fwd_tflops']:.2f} / "
                f"{r['fb_tflops'] / ours_dense['fb_tflops']:.2f}" for r in rows
                if r["seq"] == s and r["impl"] == "ours" and r["pattern"] != "dense"))
        r = time_sdpa(s, args.hq, args.hkv, args.dim, torch.bfloat16)
        sdpa = "sdpa flash" if DEVICE.type == "cuda" else "sdpa"
        print(f"{sdpa:<12} S={s}: " + " ".join(f"{k}={v:.2f}" for k, v in r.items()))
        rows.append(dict(gpu=gpu, impl=f"{sdpa} (dense causal)", pattern="dense", seq=s,
                         density=1.0, **r))
    if args.csv and rows:
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k)
                      if k in rows[0] else 99)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
