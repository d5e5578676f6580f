"""Side-by-side attention benchmark: our dilated kernels against every alternative, one run, one GPU.

Per shape (B=1, Hq=32, Hkv in {32, 8}, D in {128, 64}, S in {16K, 32K, 64K, 128K}, bf16, causal)
and pattern (``hf_hilbert_attn/patterns/longnet_lm.yaml``, ``hf_hilbert_attn/patterns/pow2.yaml``) it times, on the same inputs:

* ``ours-natural``  ``dilated_attention(..., backend="triton")`` on natural-order tensors;
* ``ours-hilbert``  the same op on tensors stored in Hilbert order (``q_positions=k_positions=perm``;
  the permutation is a layout, applied outside the timed region);
* ``sdpa-cudnn`` / ``sdpa-flash``  dense causal SDPA forced to one backend — a *different*
  (denser) function; GQA through ``enable_gqa=True`` where the backend takes it, else K/V
  expanded with ``repeat_interleave`` inside the timed region (the ``note`` column says which);
* ``gather-sdpa``  the LongNet/torchscale gather → SDPA → LSE-merge of the same pattern, labelled
  ``"gather-sdpa (double-counts overlaps)"``: keys allowed by several configs count once per config;
* ``flex``  FlexAttention with ``pattern.mask_mod(causal=True)``, compiled; block-mask build and
  first-call compile time reported apart from the run time.

Columns: fwd / bwd / fwd+bwd median ms (``triton.testing.do_bench``, warm-up first, fresh random
inputs), TFLOP/s of the pattern's allowed pairs (``pattern.attention_flops``; fwd+bwd counts 3.5×
the forward) — the comparable number for every row — and TFLOP/s of the work each row's own
function defines (dense causal pairs for SDPA, per-config pairs for gather-sdpa), peak memory of
one fwd+bwd step, and the relative error of the last ``--check-queries`` outputs against float32
references (of the pattern, and of the row's own function). Failures and OOMs are recorded per
row. A CSV and a PNG tagged with the GPU name go to ``--out-dir``; a markdown table and the speed
ratios are printed at the end.

Usage (``hf-hilbert-attn bench attention ARGS`` = ``python examples/benchmarks/bench_attention.py
ARGS``)::

    hf-hilbert-attn bench attention                                # the full table (GPU)
    hf-hilbert-attn bench attention --seq-lens 64K --kv-heads 8 --head-dims 128 \\
        --patterns longnet_lm                                      # the headline shape
    hf-hilbert-attn bench attention --max-len                      # longest S search
    hf-hilbert-attn bench attention --device cpu --ours-backend torch \\
        --seq-lens 256 --heads 4 --kv-heads 2 --head-dim 16 --quick   # CPU smoke run

It times GPU kernels: without a CUDA device it refuses at once unless ``--device cpu`` is given
(the smoke run above: it checks the pipeline, its timings mean nothing).

The full table is 32 shapes x 6 rows; FlexAttention compiles once per row and the dense rows
at 128K take seconds each, so where commands are time-limited run it in parts, e.g. one
``--patterns P --head-dims D --tag P_D`` per (pattern, head_dim), each writing its own files.
The CSV is rewritten after every row, so a part cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Dict, List, Optional

import torch

from hf_hilbert_attn import DilatedPattern, reference_attention

from ..evaluation._args import InputError, report_input_errors, results_dir, show_progress
from . import common as C
from .baselines import GATHER_LABEL, double_counted_reference
from .impls import SDPA, Flex, Gather, Unavailable, make_impl
from .max_len import max_len_main

LABELS = {
    "ours-natural": "ours natural",
    "ours-hilbert": "ours hilbert",
    "sdpa-cudnn": "sdpa-cudnn (dense causal)",
    "sdpa-flash": "sdpa-flash (dense causal)",
    "gather-sdpa": GATHER_LABEL,
    "flex": "flex (mask_mod)",
}
OURS = ("ours-natural", "ours-hilbert")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BWD_FACTOR = 2.5  # backward FLOPs / forward FLOPs (FlashAttention-2 convention, pattern.py)


# ============================================================================= inputs
def make_inputs(S, hq, hkv, D, dtype, device, seed):
    """Fresh random q, k, v (leaf tensors needing grad) and an upstream gradient dO."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(h):
        return torch.randn(1, h, S, D, generator=gen, device=device, dtype=dtype)

    q, k, v, do = rnd(hq), rnd(hkv), rnd(hkv), rnd(hq)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


# ============================================================================= one row
def run_row(key: str, ctx: dict) -> dict:
    """One implementation on one shape: first-call time, peak memory, errors vs the references,
    fwd / bwd / fwd+bwd times and TFLOP/s. A failure (OOM, error, unavailable) is the row's
    status, named with the stage it happened in."""
    device = ctx["device"]
    row = dict(ctx["base"], impl=LABELS[key], impl_key=key, status="ok", note="")
    impl = None
    at = {"stage": "setup"}
    try:
        impl = make_impl(key, ctx)
        row["build_s"] = impl.build_s
        row["own_pairs"] = impl.pairs()
        at["stage"] = "first call"
        row["first_call_s"] = _first_call(impl, device)
        if isinstance(impl, Gather):
            impl.describe()
        at["stage"] = "memory"
        _memory_and_errors(impl, ctx, row)
        _times(impl, ctx, row, at)
        if isinstance(impl, Flex):
            row["compile_s"] = row["first_call_s"]
    except Unavailable as e:
        row["status"], row["note"] = "unavailable", str(e)
    except Exception as e:  # noqa: BLE001 - every failure is a row, the run goes on
        if C.is_oom(e):
            row["status"] = "OOM"
            row["note"] = f"out of memory at {at['stage']}"
        else:
            row["status"] = "error"
            row["note"] = f"{at['stage']}: {C.short_error(e)}"
    finally:
        if impl is not None:
            row["note"] = _join(impl.note, row["note"])
            for t in impl.leaves:
                t.grad = None
        for t in (ctx["q"], ctx["k"], ctx["v"]):
            t.grad = None
        impl = None
        C.free_memory(device)

    fwd_flops = ctx["fwd_flops"]
    flops_fb = fwd_flops * (1 + BWD_FACTOR)
    own = 4.0 * ctx["D"] * row.get("own_pairs", ctx["pattern_pairs"])
    row["tflops_fwd"] = C.tflops(fwd_flops, row.get("fwd_ms"))
    row["tflops_fwd_bwd"] = C.tflops(flops_fb, row.get("fwd_bwd_ms"))
    row["own_tflops_fwd"] = C.tflops(own, row.get("fwd_ms"))
    row["own_tflops_fwd_bwd"] = C.tflops(own * (1 + BWD_FACTOR), row.get("fwd_bwd_ms"))
    return row


def _first_call(impl, device) -> float:
    """Seconds of the first fwd+bwd: Triton JIT / torch.compile / cuDNN plan creation."""
    for t in impl.leaves:
        t.grad = None
    t0 = time.perf_counter()
    try:
        impl.fwd().backward(impl.dout)
    except RuntimeError as e:
        if isinstance(impl, SDPA) and impl.group > 1 and not impl.expand and not C.is_oom(e):
            impl.fallback_to_expanded()
            t0 = time.perf_counter()
            impl.fwd().backward(impl.dout)
        else:
            raise
    C.synchronize(device)
    return time.perf_counter() - t0


def _memory_and_errors(impl, ctx: dict, row: dict) -> None:
    """Peak memory of one fwd+bwd, and the output's errors vs the float32 references."""
    device, leaves, dout = ctx["device"], impl.leaves, impl.dout
    for t in leaves:
        t.grad = None
    holder = {}

    def step_keep():
        out = impl.fwd()
        out.backward(dout)
        holder["out"] = impl.natural(out.detach(), ctx["nq"]) if ctx["nq"] else None

    mem = C.peak_memory_bytes(step_keep, device)
    row["peak_extra_gib"] = mem["extra"] / 2**30 if device.type == "cuda" else None
    row["peak_gib"] = ((mem["extra"] + ctx["input_bytes"]) / 2**30
                       if device.type == "cuda" else None)
    if ctx["nq"]:
        out = holder.pop("out").float()
        row["err_vs_pattern"] = _rel(out, ctx["refs"]["pattern"])
        row["err_vs_own"] = _rel(out, ctx["refs"][impl.own_reference()])
        row["own_function"] = {"pattern": "pattern", "dense": "dense causal",
                               "double-counted": "pattern, overlaps double-counted"}[
            impl.own_reference()]
        del out
    for t in leaves:
        t.grad = None


def _times(impl, ctx: dict, row: dict, at: dict) -> None:
    """Median fwd, bwd and fwd+bwd milliseconds (``at["stage"]`` says which is running)."""
    args, leaves, dout = ctx["args"], impl.leaves, impl.dout
    timing = dict(device=ctx["device"], warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                  grad_to_none=leaves, min_reps=1 if args.quick else 3)
    at["stage"] = "fwd"
    row["fwd_ms"] = C.bench_ms(impl.fwd, **timing)
    at["stage"] = "bwd"
    out = impl.fwd()
    try:
        row["bwd_ms"] = C.bench_ms(lambda: out.backward(dout, retain_graph=True), **timing)
    except RuntimeError as e:
        if C.is_oom(e):
            raise
        row["bwd_ms"] = None  # filled from fwd+bwd − fwd below
        row["note"] = _join(row["note"], "bwd = (fwd+bwd) - fwd: " + C.short_error(e, 60))
    del out
    at["stage"] = "fwd+bwd"
    row["fwd_bwd_ms"] = C.bench_ms(lambda: impl.fwd().backward(dout), **timing)
    if row.get("bwd_ms") is None:
        row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _join(*parts):
    return "; ".join(p for p in parts if p)


def references(ctx) -> Dict[str, torch.Tensor]:
    """float32 outputs of the last ``nq`` queries for each function a row may compute."""
    nq = ctx["nq"]
    q, k, v = (t.detach() for t in (ctx["q"], ctx["k"], ctx["v"]))
    qs = q[:, :, -nq:]
    pat = ctx["pattern"]
    refs = {"pattern": reference_attention(qs, k, v, pat, causal=True)}
    refs["dense"] = reference_attention(qs, k, v, DilatedPattern.dense(ctx["S"]), causal=True)
    refs["double-counted"] = double_counted_reference(qs, k, v, pat, causal=True)
    C.free_memory(ctx["device"])
    return refs


# ============================================================================= the table
def run_table(args, device, csv_path=None) -> List[dict]:
    """All rows; the CSV at ``csv_path`` is rewritten after every row, so a run cut short by a
    time limit still leaves what it measured."""
    from tqdm import tqdm

    env = C.environment(device)
    dtype = DTYPES[args.dtype]
    patterns = [C.load_pattern(p) for p in args.patterns]
    shapes = [(pn, pat, S, hkv, D) for pn, pat in patterns for hkv in args.kv_heads
              for D in args.head_dims for S in args.seq_lens]
    rows = []
    bar = tqdm(total=len(shapes) * len(args.impls), desc="bench_attention", file=sys.stderr,
               disable=not show_progress())
    for i, (pname, pat, S, hkv, D) in enumerate(shapes):
        if args.heads % hkv:
            raise InputError(f"--heads {args.heads} is not a multiple of --kv-heads {hkv}")
        try:  # dense key/value heads must exist; counting them needs Hkv
            pat.check_kv_heads(hkv)
        except ValueError as e:
            raise InputError(f"pattern {pname} with --kv-heads {hkv}: {e}") from None
        q, k, v, do = make_inputs(S, args.heads, hkv, D, dtype, device, args.seed + i)
        fwd_flops = pat.attention_flops(S, args.heads, D, causal=True, num_kv_heads=hkv)
        ctx = dict(args=args, device=device, pattern=pat, S=S, hq=args.heads, hkv=hkv, D=D,
                   q=q, k=k, v=v, do=do, nq=min(args.check_queries, S),
                   pattern_pairs=pat.count_pairs_total(S, args.heads, causal=True,
                                                       num_kv_heads=hkv),
                   fwd_flops=fwd_flops,
                   input_bytes=sum(t.numel() * t.element_size() for t in (q, k, v, do)))
        ctx["base"] = dict(env, pattern=pname, seq_len=S, batch=1, heads_q=args.heads,
                           heads_kv=hkv, head_dim=D, dtype=args.dtype, causal=True,
                           pattern_pairs=ctx["pattern_pairs"],
                           density=ctx["pattern_pairs"] / (args.heads * S * (S + 1) / 2))
        if ctx["nq"]:
            ctx["refs"] = references(ctx)
        for key in args.impls:
            bar.set_postfix_str(f"{pname} S={C.fmt_size(S)} Hkv={hkv} D={D} {key}")
            row = run_row(key, ctx)
            rows.append(row)
            bar.update(1)
            if csv_path is not None:
                C.write_csv(rows, csv_path)
            if not args.quiet:
                tqdm.write(_row_line(row), file=sys.stderr)
        del q, k, v, do, ctx
        C.free_memory(device)
    bar.close()
    return rows


def _row_line(r):
    def f(x, spec="{:.2f}"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)

    return (f"{r['pattern']} S={C.fmt_size(r['seq_len'])} Hkv={r['heads_kv']} D={r['head_dim']} "
            f"{r['impl']}: {r['status']} fwd {f(r.get('fwd_ms'))} ms, fwd+bwd "
            f"{f(r.get('fwd_bwd_ms'))} ms, {f(r.get('tflops_fwd_bwd'), '{:.1f}')} TFLOP/s "
            f"(pattern) {r.get('note', '')}")


TABLE_COLUMNS = [
    ("pattern", "pattern", None), ("S", "S_str", None), ("Hkv", "heads_kv", None),
    ("D", "head_dim", None), ("impl", "impl", None), ("status", "status", None),
    ("fwd ms", "fwd_ms", "{:.2f}"), ("bwd ms", "bwd_ms", "{:.2f}"),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.2f}"),
    ("pattern TFLOP/s fwd", "tflops_fwd", "{:.1f}"),
    ("pattern TFLOP/s fwd+bwd", "tflops_fwd_bwd", "{:.1f}"),
    ("own-function TFLOP/s fwd+bwd", "own_tflops_fwd_bwd", "{:.1f}"),
    ("peak GiB", "peak_gib", "{:.2f}"), ("err vs pattern", "err_vs_pattern", "{:.1e}"),
    ("err vs own fn", "err_vs_own", "{:.1e}"), ("build s", "build_s", "{:.2f}"),
    ("first call s", "first_call_s", "{:.2f}"),
]


def ratios(rows: List[dict]) -> List[dict]:
    """Per shape: fwd+bwd speed-up of each of our rows over every other row, memory vs flash."""
    out = []
    shape_key = ("pattern", "seq_len", "heads_kv", "head_dim")
    shapes = dict.fromkeys(tuple(r[k] for k in shape_key) for r in rows)
    for shape in shapes:
        sub = {r["impl_key"]: r for r in rows if tuple(r[k] for k in shape_key) == shape}
        for ours in OURS:
            o = sub.get(ours)
            if not o or o["status"] != "ok":
                continue
            for key, b in sub.items():
                # hilbert-vs-natural is reported once, from the hilbert side.
                if key == ours or b["status"] != "ok" or (ours, key) == OURS:
                    continue
                out.append(dict(zip(shape_key, shape), ours=LABELS[ours], baseline=b["impl"],
                                speedup_fwd_bwd=b["fwd_bwd_ms"] / o["fwd_bwd_ms"],
                                speedup_fwd=b["fwd_ms"] / o["fwd_ms"],
                                memory_ratio=(o["peak_gib"] / b["peak_gib"]
                                              if o.get("peak_gib") and b.get("peak_gib") else None)))
    return out


def report(rows, ratio_rows, paths, args, device):
    for r in rows:
        r["S_str"] = C.fmt_size(r["seq_len"])
    print(f"\n## Attention benchmark on {C.device_name(device)} "
          f"(torch {torch.__version__}, B=1, Hq={args.heads}, {args.dtype}, causal)\n")
    print("pattern TFLOP/s = the pattern's allowed pairs (count_pairs) x 4D per pair (x3.5 for "
          "fwd+bwd) / time, the same numerator for every row; own-function TFLOP/s counts what "
          "the row's own function covers (dense causal pairs for SDPA, per-config pairs for "
          f"{GATHER_LABEL}). peak GiB = inputs (q, k, v, dO) + the fwd+bwd step's peak.\n")
    print(C.markdown_table(rows, TABLE_COLUMNS))
    print("\n### fwd+bwd speed-up of ours = baseline ms / ours ms (> 1: ours faster); "
          "memory = ours peak / baseline peak\n")
    if device.type != "cuda":
        print("(CPU smoke run: these timings swing several times between runs and the kernels "
              "under test are GPU kernels; the ratios check the pipeline, they measure nothing)\n")
    print(C.markdown_table(
        [dict(r, S_str=C.fmt_size(r["seq_len"])) for r in ratio_rows],
        [("pattern", "pattern", None), ("S", "S_str", None), ("Hkv", "heads_kv", None),
         ("D", "head_dim", None), ("ours", "ours", None), ("baseline", "baseline", None),
         ("speed-up fwd+bwd", "speedup_fwd_bwd", "{:.2f}x"), ("speed-up fwd", "speedup_fwd", "{:.2f}x"),
         ("memory ratio", "memory_ratio", "{:.2f}")]))
    hil = [r for r in ratio_rows if r["ours"] == LABELS["ours-hilbert"]
           and r["baseline"] == LABELS["ours-natural"]]
    if hil:
        print("\nhilbert vs natural (natural ms / hilbert ms, > 1: hilbert faster): "
              + ", ".join(f"{r['pattern']} S={C.fmt_size(r['seq_len'])} Hkv={r['heads_kv']} "
                          f"D={r['head_dim']}: {r['speedup_fwd_bwd']:.2f}" for r in hil))
    print("\nwrote " + ", ".join(str(p) for p in paths))


# ============================================================================= CLI
def parse_args(argv=None, prog: Optional[str] = None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = lambda s: [C.parse_size(x) for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--seq-lens", type=sizes, default=None,
                   help="comma list, e.g. 16K,32K,64K,128K (default; --quick: 16K)")
    p.add_argument("--heads", type=int, default=32, help="query heads Hq (default 32)")
    p.add_argument("--kv-heads", type=ints, default=[32, 8], help="comma list (default 32,8)")
    p.add_argument("--head-dims", "--head-dim", dest="head_dims", type=ints, default=[128, 64],
                   help="comma list (default 128,64)")
    p.add_argument("--patterns", type=words, default=["longnet_lm", "pow2"],
                   help="shipped pattern names, YAML paths or inline W1,W2:R1,R2 specs, "
                        "comma-separated (default longnet_lm,pow2)")
    p.add_argument("--impls", type=words, default=list(LABELS),
                   help=f"subset of {','.join(LABELS)}")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", default=None,
                   help="cuda (default) or cuda:N; cpu only for a smoke run with "
                        "--ours-backend torch")
    p.add_argument("--ours-backend", choices=["triton", "auto", "torch"], default="triton",
                   help="backend= of dilated_attention for our rows (torch: CPU smoke runs)")
    p.add_argument("--gather-kernel", choices=["auto", "flash", "math"], default="auto",
                   help="segment kernel of gather-sdpa (auto: fused flash op, self-checked)")
    p.add_argument("--out-dir", default=results_dir("bench_attention"))
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--quick", action="store_true",
                   help="short timing budgets (and S=16K unless --seq-lens is given)")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repeat budget (default 100)")
    p.add_argument("--check-queries", type=int, default=64,
                   help="compare the last N queries' outputs to float32 references (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="don't print each row as it finishes")
    p.add_argument("--max-len", action="store_true",
                   help="search the longest S instead of the table (ours-natural and sdpa-flash)")
    p.add_argument("--max-len-start", type=C.parse_size, default=C.parse_size("64K"))
    p.add_argument("--max-len-cap", type=C.parse_size, default=C.parse_size("256M"))
    p.add_argument("--max-len-granularity", type=C.parse_size, default=C.parse_size("16K"))
    p.add_argument("--max-len-trial-s", type=float, default=120.0,
                   help="skip a trial predicted to run longer than this")
    args = p.parse_args(argv)
    unknown = [i for i in args.impls if i not in LABELS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(LABELS)}")
    if args.seq_lens is None:
        args.seq_lens = [C.parse_size("16K")] if args.quick else [
            C.parse_size(s) for s in ("16K", "32K", "64K", "128K")]
    if args.warmup_ms is None:
        args.warmup_ms = 5.0 if args.quick else 25.0
    if args.rep_ms is None:
        args.rep_ms = 20.0 if args.quick else 100.0
    return args


CPU_SMOKE = ("--device cpu --ours-backend torch --seq-lens 256 --heads 4 --kv-heads 2 "
             "--head-dim 16 --quick")


def main(argv=None, prog: Optional[str] = None) -> int:
    return report_input_errors(lambda: _main(argv, prog), prog or "bench_attention.py")


def _main(argv, prog) -> int:
    args = parse_args(argv, prog)
    if args.device is None and not torch.cuda.is_available():
        raise InputError(f"this benchmark times GPU kernels and torch sees no CUDA device here; "
                         f"for a CPU smoke run (timings meaningless) add {CPU_SMOKE}")
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: torch sees no CUDA device here; for a CPU "
                         f"smoke run use {CPU_SMOKE}")
    if device.type == "cpu" and args.ours_backend == "triton":
        raise InputError("--device cpu needs --ours-backend torch (the Triton kernels need a GPU)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)
    if args.max_len:
        return max_len_main(args, device, LABELS)
    paths = C.output_paths(args.out_dir, "bench_attention", device, args.tag)
    rows = run_table(args, device, paths["csv"])
    ratio_rows = ratios(rows)
    ratio_path = paths["csv"].with_name(paths["csv"].stem + "_ratios.csv")
    C.write_csv(rows, paths["csv"])
    C.write_csv(ratio_rows or [{"note": "no pair of ok rows to compare"}], ratio_path)
    for r in rows:
        r["panel"] = f"{r['pattern']} Hkv={r['heads_kv']} D={r['head_dim']}"
    C.plot_panels(rows, paths["png"], panel_key="panel", series_key="impl", x_key="seq_len",
                  y_key="tflops_fwd_bwd", xlabel="sequence length",
                  ylabel="pattern TFLOP/s (fwd+bwd)", logy=False,
                  title=f"Dilated attention fwd+bwd, useful (pattern-pair) TFLOP/s — "
                        f"{C.device_name(device)}, Hq={args.heads}, {args.dtype}")
    report(rows, ratio_rows, [paths["csv"], ratio_path, paths["png"]], args, device)
    return 0

