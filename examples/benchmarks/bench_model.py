"""End-to-end benchmark on one GPU: a Llama-3.2-1B-shaped model (random init, bf16), forward +
backward with gradient checkpointing at 16K–128K tokens, ``sdpa`` vs ``hilbert_dilated``
(``hf_hilbert_attn/patterns/longnet_lm.yaml``): tokens/s, peak memory, ratios; ``--max-len`` finds the longest
sequence each runs. Writes CSV + PNG + markdown tagged with the GPU name into ``--out-dir``.

    python examples/benchmarks/bench_model.py --preset 1b --max-len   # GPU
    python examples/benchmarks/bench_model.py --preset tiny           # CPU smoke test

Same as ``hf-hilbert-attn bench model``; the logic lives in
``hf_hilbert_attn.tools.evaluation.bench_model`` (its docstring explains the memory outside
attention).
"""

import sys

from hf_hilbert_attn.tools.evaluation.bench_model import main

if __name__ == "__main__":
    sys.exit(main(prog="bench_model.py"))
