"""``bench attention --max-len``: the longest sequence each implementation runs on one GPU
(ours vs dense flash SDPA), found by doubling the length until a run fails, then bisecting."""

from __future__ import annotations

import sys
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

from hf_hilbert_attn import dilated_attention

from . import common as C


def _trial(impl: str, S: int, hq: int, hkv: int, D: int, dtype, device, grad: bool,
           pattern, backend: str) -> dict:
    """Run one fwd(+bwd) at length S; returns {"ok", "s", "peak_gib", "why"}."""
    res = {"ok": False, "s": None, "peak_gib": None, "why": ""}
    tensors = []
    try:
        gen = torch.Generator(device=device).manual_seed(S)
        q = torch.randn(1, hq, S, D, generator=gen, device=device, dtype=dtype)
        k = torch.randn(1, hkv, S, D, generator=gen, device=device, dtype=dtype)
        v = torch.randn(1, hkv, S, D, generator=gen, device=device, dtype=dtype)
        tensors = [q, k, v]
        for t in tensors:
            t.requires_grad_(grad)

        def call():
            if impl == "ours-natural":
                return dilated_attention(q, k, v, pattern, causal=True, backend=backend)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      enable_gqa=hq != hkv)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        C.synchronize(device)
        t0 = time.perf_counter()
        if grad:
            out = call()
            out.backward(torch.randn_like(out))
            del out
        else:
            with torch.no_grad():
                out = call()
                del out
        C.synchronize(device)
        res.update(ok=True, s=time.perf_counter() - t0)
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as e:  # noqa: BLE001
        res["why"] = "OOM" if C.is_oom(e) else C.short_error(e, 100)
    finally:
        for t in tensors:
            t.grad = None
        del tensors
        C.free_memory(device)
    return res


def search_max_len(impl, case, args, device, pattern, labels: Dict[str, str]) -> dict:
    """Double S until a run fails, then bisect (coarse: to 1/16 of the last good length).

    A trial predicted to take longer than ``--max-len-trial-s`` (from the last one, assuming
    time ∝ S² for dense SDPA and ∝ S for ours) is not run; the result then says so.
    """
    hq, hkv, D, dtype, grad = case["hq"], case["hkv"], case["D"], case["dtype"], case["grad"]
    growth = 2.0 if impl == "ours-natural" else 4.0
    lo, hi, lo_res, why_hi, stopped = None, None, None, "", ""
    S = args.max_len_start
    last = None
    while S <= args.max_len_cap:
        if last is not None and last["s"] * growth > args.max_len_trial_s:
            stopped = f"next trial predicted > {args.max_len_trial_s:.0f} s"
            break
        r = _trial(impl, S, hq, hkv, D, dtype, device, grad, pattern, args.ours_backend)
        print(f"  max-len {impl} {case['name']} S={C.fmt_size(S)}: "
              f"{'ok %.2f s' % r['s'] if r['ok'] else r['why']}", file=sys.stderr)
        if not r["ok"]:
            hi, why_hi = S, r["why"]
            break
        lo, lo_res, last = S, r, r
        S *= 2
    else:
        stopped = f"reached --max-len-cap {C.fmt_size(args.max_len_cap)}"
    if lo is not None and hi is not None and why_hi == "OOM":
        gran = max(args.max_len_granularity, lo // 16)
        while hi - lo > gran:
            mid = (lo + hi) // 2 // args.max_len_granularity * args.max_len_granularity
            if mid <= lo or mid >= hi:
                break
            if lo_res["s"] * (mid / lo) ** (growth / 2) > args.max_len_trial_s:
                stopped = f"bisection trial predicted > {args.max_len_trial_s:.0f} s"
                break
            r = _trial(impl, mid, hq, hkv, D, dtype, device, grad, pattern, args.ours_backend)
            print(f"  max-len {impl} {case['name']} S={mid}: "
                  f"{'ok %.2f s' % r['s'] if r['ok'] else r['why']}", file=sys.stderr)
            if r["ok"]:
                lo, lo_res = mid, r
            elif r["why"] == "OOM":
                hi = mid
            else:
                hi, why_hi = mid, r["why"]
                break
    return dict(C.environment(device), impl=labels.get(impl, impl), case=case["name"],
                heads_q=hq, heads_kv=hkv, head_dim=D, dtype=case["dtype_name"],
                max_ok_len=lo, max_ok_str=C.fmt_size(lo) if lo else "none",
                first_fail_len=hi, fail_reason=why_hi, stopped=stopped,
                time_at_max_s=lo_res["s"] if lo_res else None,
                peak_gib_at_max=lo_res["peak_gib"] if lo_res else None)


def run_max_len(args, device, labels: Dict[str, str]) -> List[dict]:
    """One row per (case, implementation); ``labels``: the rows' names of the implementations."""
    _, pattern = C.load_pattern(args.patterns[0])
    cases = [
        dict(name="fwd+bwd Hq=32 Hkv=8 D=128 bf16", hq=32, hkv=8, D=128, dtype=torch.bfloat16,
             dtype_name="bf16", grad=True),
        dict(name="fwd no-grad H=8 D=64 fp16", hq=8, hkv=8, D=64, dtype=torch.float16,
             dtype_name="fp16", grad=False),
    ]
    if args.quick:  # tiny shapes so the search itself can be smoke-tested on CPU
        for c in cases:
            c.update(hq=args.heads, hkv=min(args.kv_heads), D=min(args.head_dims))
            c["name"] += f" (quick: Hq={c['hq']} Hkv={c['hkv']} D={c['D']})"
    rows = []
    for case in cases:
        for impl in ("ours-natural", "sdpa-flash"):
            if impl == "sdpa-flash" and device.type != "cuda":
                rows.append(dict(C.environment(device), impl=labels[impl], case=case["name"],
                                 max_ok_str="unavailable", fail_reason="needs CUDA"))
                continue
            rows.append(search_max_len(impl, case, args, device, pattern, labels))
    return rows


def max_len_main(args, device, labels: Dict[str, str]) -> int:
    """Run the search, write its CSV and print its table."""
    rows = run_max_len(args, device, labels)
    paths = C.output_paths(args.out_dir, "bench_attention_maxlen", device, args.tag)
    C.write_csv(rows, paths["csv"])
    print(f"\n## Longest sequence on {C.device_name(device)} (pattern {args.patterns[0]})\n")
    print(C.markdown_table(rows, [
        ("case", "case", None), ("impl", "impl", None), ("max S ok", "max_ok_str", None),
        ("max S", "max_ok_len", "{:d}"), ("first fail", "first_fail_len", "{:d}"),
        ("why", "fail_reason", None), ("stopped", "stopped", None),
        ("s at max", "time_at_max_s", "{:.2f}"), ("peak GiB", "peak_gib_at_max", "{:.1f}")]))
    print(f"\nwrote {paths['csv']}")
    return 0
