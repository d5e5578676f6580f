"""Side-by-side attention benchmark on one GPU: our dilated kernels (natural and Hilbert order)
against dense SDPA (cuDNN, flash), gather-SDPA and FlexAttention, per shape and pattern.

    python examples/benchmarks/bench_attention.py                  # the full table (GPU)
    python examples/benchmarks/bench_attention.py --device cpu --ours-backend torch \
        --seq-lens 256 --heads 4 --kv-heads 2 --head-dim 16 --quick   # CPU smoke run

Same as ``hf-hilbert-attn bench attention``; the logic lives in
``hf_hilbert_attn.tools.benchmarks.attention`` (its docstring lists the columns and options).
"""

import sys

from hf_hilbert_attn.tools.benchmarks.attention import LABELS, main  # noqa: F401  (LABELS: tests)

if __name__ == "__main__":
    sys.exit(main(prog="bench_attention.py"))
