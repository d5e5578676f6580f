"""Registers, spills and shared memory of every kernel launch, compiled for a GPU without one.

    python examples/benchmarks/kernel_resources.py --seq 65536 --hq 32 --hkv 8 --dim 128
    python examples/benchmarks/kernel_resources.py --env HF_HILBERT_DKDV_BLOCKS=32,128,8,2 \
        --csv r.csv

One forward and backward is recorded on CPU tensors (nothing runs), every distinct kernel
specialization is compiled for ``--arch`` (with the tiles the launchers pick on that GPU) as
Triton's JIT would specialise it, and ``ptxas -v`` reports registers per thread, spill
stores/loads and the stack frame (``hf_hilbert_attn.tools.aot``); ``shared`` must stay within
``shared_limit``, and ``hopper_only`` counts sm_90-only instructions (none below sm_90).
A kernel that spills sends part of its accumulators through local memory on every key tile:
the first thing to check when a kernel runs far below the tensor-core rate. Timing still needs
the GPU (``kernel_timing.py``); this shows in seconds, on any machine with a Linux Triton
wheel, what a tile size or a kernel change does to the register budget. Triton versions
differ: say which one a number came from (printed in the first line), and screen with the
version the GPU runs (``pip install --no-deps --target DIR triton==X`` and ``DIR`` first on
``PYTHONPATH``): Triton 3.6 spills 452 bytes in a dk/dv tile where 3.9 spills 148
(docs/decisions.md D91). A pattern with dense key/value heads records what the op launches
for it: the sparse part over every head, and plain attention over the dense heads' slice.
"""

import argparse
import csv
import os
import sys

import torch

COLS = ("kernel", "variant", "warps", "stages", "registers", "spill_stores", "spill_loads",
        "stack", "shared", "shared_limit", "narrow_loads", "hopper_only", "launches", "compile_s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--pattern", default="longnet_lm",
                   help="a shipped pattern name or a YAML file (default longnet_lm)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--arch", type=int, default=90, choices=(80, 86, 89, 90),
                   help="compute capability: 80 A100, 86 RTX 3090, 89 RTX 4090 / L4, 90 H100")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set a tuning variable first (e.g. HF_HILBERT_FWD_BLOCKS=64,64,4,3)")
    p.add_argument("--csv", help="also write the table here")
    args = p.parse_args(argv)
    for kv in args.env:
        if "=" not in kv:
            p.error(f"--env takes NAME=VALUE, got {kv!r}")
        name, value = kv.split("=", 1)
        os.environ[name] = value
    import triton

    from hf_hilbert_attn.dense_heads import DENSE
    from hf_hilbert_attn.patterns import as_pattern
    from hf_hilbert_attn.tools import aot

    why = aot.available()
    if why:
        p.error(why)
    if aot.ptxas_path(args.arch) is None:
        p.error("this Triton install ships no ptxas (Linux x86-64 wheels do)")
    pattern = as_pattern(args.pattern)
    if args.hkv < 1 or args.hq % args.hkv:
        p.error(f"--hq ({args.hq}) must be a multiple of --hkv ({args.hkv})")
    try:
        pattern.check_kv_heads(args.hkv)
    except ValueError as e:
        p.error(f"--pattern: {e}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    q = torch.empty(1, args.hq, args.seq, args.dim, dtype=dtype)
    k = torch.empty(1, args.hkv, args.seq, args.dim, dtype=dtype)
    kw = dict(causal=not args.no_causal, backward=not args.forward_only, arch=args.arch)
    # the kernels never see dense heads: the op runs the sparse part over every head, and
    # plain attention over the dense heads' slice (hf_hilbert_attn/dense_heads.py)
    calls = aot.launches(q, k, k, pattern.sparse_part, **kw)
    if pattern.dense_kv_heads:
        nd, g = len(pattern.dense_kv_heads), args.hq // args.hkv
        calls += aot.launches(q[:, :nd * g], k[:, :nd], k[:, :nd], DENSE, **kw)
    print(f"sm_{args.arch}, Triton {triton.__version__}, S={args.seq} Hq={args.hq} "
          f"Hkv={args.hkv} D={args.dim} {args.dtype}, {pattern}"
          + "".join(f", {kv}" for kv in args.env), flush=True)
    rows = aot.compile_all(calls, args.arch, progress=lambda r: print(
        f"  compiled {r['kernel']} in {r['compile_s']} s", file=sys.stderr, flush=True))
    print("| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in COLS) + " |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
