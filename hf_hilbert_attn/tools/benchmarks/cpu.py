"""CPU benchmark: the PyTorch path of ``dilated_attention`` vs causal SDPA, side by side.

Per (shape, length) the implementations run interleaved (SDPA, then each pattern, repeated),
and each reports its median, so a load that comes and goes on a shared machine hits all of
them alike. ``fwd_ratio`` is SDPA's time over ours (above 1: ours is faster); ``fwdbwd_*``
time forward + backward of ``<out, dout>``. ``--model`` adds a tiny Llama's forward with
``attn_implementation="hilbert_dilated"`` vs ``"sdpa"`` (random weights). The defaults (two
shapes, 1K-16K, two patterns) take about 3 minutes on 2 cores; a step's time grows with its
length squared (32K alone: about 10 more).

    hf-hilbert-attn bench cpu --lengths 1K 4K 8K 16K 32K --backward
    python -m hf_hilbert_attn.tools.benchmarks.cpu --lengths 4K 8K --shapes 9/3x64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..evaluation._args import results_dir
from ..progress import progress_bar
from . import common as C

SHAPES = ("9/3x64", "32/8x128")  # SmolLM2-135M's heads, and a 1B-style shape


def parse_shape(text: str) -> tuple:
    """``"9/3x64"`` -> (Hq 9, Hkv 3, D 64)."""
    try:
        heads, d = text.split("x")
        hq, hkv = heads.split("/")
        out = int(hq), int(hkv), int(d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 9/3x64 (Hq/Hkv x D), got {text!r}")
    if min(out) < 1 or out[0] % out[1]:
        raise argparse.ArgumentTypeError(f"shape {text!r}: Hq must be a multiple of Hkv >= 1")
    return out


def _size(text: str) -> int:
    try:
        return C.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=_size,
                   default=[_size(x) for x in ("1K", "4K", "8K", "16K")],
                   help="sequence lengths (default 1K 4K 8K 16K)")
    p.add_argument("--shapes", nargs="+", type=parse_shape,
                   default=[parse_shape(s) for s in SHAPES],
                   help="Hq/HkvxD (default 9/3x64 32/8x128)")
    p.add_argument("--patterns", nargs="+", default=["longnet_lm", "default"],
                   help="shipped names, YAML paths or W1,W2:R1,R2 (default longnet_lm default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (median)")
    p.add_argument("--backward", action="store_true", help="also time forward + backward")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: as is)")
    p.add_argument("--model", action="store_true",
                   help="also a tiny Llama forward per length, hilbert_dilated vs sdpa")
    p.add_argument("--out", default=results_dir("bench_cpu"),
                   help="folder for the CSV and Markdown (default %(default)s)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--seed", type=int, default=0)
    return p


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median ms of each ``fns`` entry, run in turn ``repeats`` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def _attention_fns(q, k, v, patterns, backward: bool):
    from hf_hilbert_attn.ops import dilated_attention

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    impls = {"sdpa": sdpa}
    for name, pattern in patterns:
        impls[name] = (lambda p: lambda q, k, v: dilated_attention(q, k, v, p, backend="torch"))(
            pattern)
    fwd = {name: (lambda f: lambda: f(q, k, v))(f) for name, f in impls.items()}
    if not backward:
        return fwd, None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def step(f):
        def run():
            f(*leaves).backward(dout)
            for t in leaves:
                t.grad = None
        return run
    return fwd, {name: step(f) for name, f in impls.items()}


def _progress(args, costs: list, what: str):
    """Lines on a stderr that is not a terminal (each row's own line shows progress there);
    the time left weighs each step by its cost (``costs``: a step's length squared times its
    heads and head size), not as an average step."""
    return progress_bar(total=len(costs), desc=f"bench cpu ({what})", unit="steps",
                        terminal_bar=False, weights=costs, disable=args.no_progress)


def bench_attention(args, patterns) -> List[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    costs = [s * s * hq * d for hq, _, d in args.shapes for s in args.lengths]
    with _progress(args, costs, "attention") as bar:
        for hq, hkv, d in args.shapes:
            for s in args.lengths:
                bar.set_postfix_str(f"running {hq}/{hkv}x{d} at {C.fmt_size(s)}"
                                    + (", fwd+bwd" if args.backward else ""))
                gen = torch.Generator().manual_seed(args.seed)
                q, k, v = (torch.randn(1, h, s, d, generator=gen, dtype=dtype)
                           for h in (hq, hkv, hkv))
                fwd, fwdbwd = _attention_fns(q, k, v, patterns, args.backward)
                with torch.no_grad():
                    t_fwd = _interleaved(fwd, args.repeats)
                t_bwd = _interleaved(fwdbwd, args.repeats) if fwdbwd else {}
                for name, _ in patterns:
                    row = {"pattern": name, "shape": f"{hq}/{hkv}x{d}", "length": s,
                           "dtype": args.dtype, "threads": torch.get_num_threads(),
                           "sdpa_fwd_ms": t_fwd["sdpa"], "ours_fwd_ms": t_fwd[name],
                           "fwd_ratio": t_fwd["sdpa"] / t_fwd[name]}
                    if t_bwd:
                        row.update(sdpa_fwdbwd_ms=t_bwd["sdpa"], ours_fwdbwd_ms=t_bwd[name],
                                   fwdbwd_ratio=t_bwd["sdpa"] / t_bwd[name])
                    rows.append(row)
                    print(_line(row), flush=True)
                bar.update(1)
    rows.sort(key=lambda r: ([n for n, _ in patterns].index(r["pattern"]), r["shape"], r["length"]))
    return rows


def bench_model(args, patterns) -> List[dict]:
    """A tiny Llama (SmolLM2-like heads, 2 layers, random weights) forward at each length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_hilbert_attn

    rows = []
    with _progress(args, [s * s for s in args.lengths], "tiny Llama forward") as bar:
        for s in args.lengths:
            bar.set_postfix_str(f"running {C.fmt_size(s)} tokens")
            cfg = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                              max_position_embeddings=max(s, 2048))
            torch.manual_seed(args.seed)
            ids = torch.randint(0, cfg.vocab_size, (1, s))
            models = {}
            for impl in ("sdpa", "hilbert_dilated"):
                torch.manual_seed(args.seed)
                models[impl] = LlamaForCausalLM._from_config(
                    cfg, attn_implementation=impl).eval()
            fns = {"sdpa": lambda: models["sdpa"](ids)}
            for name, pattern in patterns:
                hf_hilbert_attn.configure(models["hilbert_dilated"], pattern)
                fns[name] = (lambda p: lambda: (
                    hf_hilbert_attn.configure(models["hilbert_dilated"], p),
                    models["hilbert_dilated"](ids)))(pattern)
            with torch.no_grad():
                t = _interleaved(fns, args.repeats)
            for name, _ in patterns:
                row = {"pattern": name, "shape": "llama-2L-576-9/3x64", "length": s,
                       "dtype": "float32", "threads": torch.get_num_threads(),
                       "sdpa_fwd_ms": t["sdpa"], "ours_fwd_ms": t[name],
                       "fwd_ratio": t["sdpa"] / t[name]}
                rows.append(row)
                print(_line(row), flush=True)
            bar.update(1)
    return rows


def _line(row: dict) -> str:
    text = (f"{row['pattern']:>12} {row['shape']:>10} {C.fmt_size(row['length']):>5}  fwd: "
            f"sdpa {row['sdpa_fwd_ms']:9.1f} ms  ours {row['ours_fwd_ms']:9.1f} ms  "
            f"x{row['fwd_ratio']:.2f}")
    if "fwdbwd_ratio" in row:
        text += (f"  | fwd+bwd: sdpa {row['sdpa_fwdbwd_ms']:9.1f}  ours "
                 f"{row['ours_fwdbwd_ms']:9.1f}  x{row['fwdbwd_ratio']:.2f}")
    return text


COLUMNS = [("pattern", "pattern", None), ("shape", "shape", None), ("length", "length_s", None),
           ("SDPA fwd ms", "sdpa_fwd_ms", "{:.1f}"), ("ours fwd ms", "ours_fwd_ms", "{:.1f}"),
           ("fwd ×SDPA", "fwd_ratio", "{:.2f}"), ("SDPA fwd+bwd ms", "sdpa_fwdbwd_ms", "{:.1f}"),
           ("ours fwd+bwd ms", "ours_fwdbwd_ms", "{:.1f}"), ("fwd+bwd ×SDPA", "fwdbwd_ratio",
                                                             "{:.2f}")]


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> List[dict]:
    args = build_parser(prog).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    patterns = [C.load_pattern(spec) for spec in args.patterns]
    rows = bench_attention(args, patterns)
    if args.model:
        rows += bench_model(args, patterns)
    # named by the thread count, as the GPU benchmarks by the card: other counts, other files
    tag = "_" + C.sanitize(args.tag) if args.tag else ""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    csv_path = Path(args.out) / f"cpu_{torch.get_num_threads()}threads{tag}.csv"
    replaced = csv_path.exists()
    C.write_csv(rows, csv_path)
    for r in rows:
        r["length_s"] = C.fmt_size(r["length"])
    cols = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    table = (f"Ours (`dilated_attention`, PyTorch path) vs causal SDPA on CPU, {args.dtype}, "
             f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved runs; "
             f"×SDPA = SDPA time / ours (above 1: ours faster).\n\n"
             + C.markdown_table(rows, cols) + "\n")
    md = csv_path.with_suffix(".md")
    md.write_text(table)
    print(table)
    print(f"wrote {csv_path} and {md}" + (" (replacing an earlier run's: --tag keeps both)"
                                          if replaced else ""))
    return rows


if __name__ == "__main__":
    main()
