"""A training step with dense key/value heads, run by the kernels in the call itself or split
into two calls (the sparse pattern, then SDPA on the dense heads), side by side with SDPA (GPU).

    python examples/benchmarks/dense_heads_step.py --shape 135m --lengths 4096 16384 --rounds 2
    python examples/benchmarks/dense_heads_step.py --shape 1b --lengths 65536 --steps 2 --warmup 1

Per (length, round), a random-initialised Llama shape (``tools.models.MODEL_SHAPES``, bf16,
gradient checkpointing, chunked loss: ``hf-hilbert-attn bench model``'s step) is timed as the
median of ``--steps`` synchronised steps after ``--warmup``, for: ``sdpa``; ``default`` (the
default pattern); ``default+kv0`` with key/value head 0 dense, ``in-kernels`` (one call, the
dense heads its own launches) and ``two-calls`` (``ops.DENSE_HEADS_IN_KERNELS_ROWS`` set so
that no call qualifies). ``vs_sdpa``: SDPA's step time over the row's, in the same round.
Rounds repeat the rows in the same order, to show the host's noise. Writes ``--csv``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_hilbert_attn import ops
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.benchmarks.common import write_csv
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

ROWS = (("sdpa", None), ("default", None), ("default+kv0", "in-kernels"),
        ("default+kv0", "two-calls"))


def step_seconds(shape: str, tokens: int, method: str, steps: int, warmup: int) -> float:
    """Median seconds of a training step of ``method`` (``sdpa``, ``default``, ``default+kv0``)."""
    device = torch.device("cuda")
    pattern = None
    if method != "sdpa":
        pattern = as_pattern("default")
        if method.endswith("+kv0"):
            pattern = pattern.replace(dense_kv_heads=(0,))
    model = build_model(MODEL_SHAPES[shape], "sdpa" if method == "sdpa" else "hilbert_dilated",
                        torch.bfloat16, device, pattern=pattern)
    ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, tokens), device=device)
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        train_step(model, ids)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="135m", choices=sorted(MODEL_SHAPES))
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    limit, rows = ops.DENSE_HEADS_IN_KERNELS_ROWS, []
    try:
        for tokens in args.lengths:
            for rnd in range(args.rounds):
                base = None
                for method, dense in ROWS:
                    ops.DENSE_HEADS_IN_KERNELS_ROWS = 0 if dense == "two-calls" else 1 << 30
                    sec = step_seconds(args.shape, tokens, method, args.steps, args.warmup)
                    base = sec if method == "sdpa" else base
                    row = dict(gpu=torch.cuda.get_device_name(), shape=args.shape,
                               tokens=tokens, round=rnd, method=method, dense_heads=dense or "",
                               step_ms=round(sec * 1e3, 2), tokens_per_s=round(tokens / sec),
                               vs_sdpa=round(base / sec, 3))
                    rows.append(row)
                    print(",".join(str(v) for v in row.values()), flush=True)
    finally:
        ops.DENSE_HEADS_IN_KERNELS_ROWS = limit
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
