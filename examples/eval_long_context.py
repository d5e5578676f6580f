"""Long-context eval: perplexity vs context length, passkey retrieval, tokens/s and peak memory,
``sdpa`` vs ``hilbert_dilated`` with one or more patterns.

    python examples/eval_long_context.py                       # built-in tiny model, CPU, < 1 min
    python examples/eval_long_context.py ./my-model --pattern longnet_lm \
        --lengths 4k 8k 16k 32k --corpus data/*.jsonl --out-dir eval_results

Same as ``hf-hilbert-attn eval``; the logic lives in ``hf_hilbert_attn.tools.evaluation``.
"""

import sys

from hf_hilbert_attn.tools.evaluation.runner import main

if __name__ == "__main__":
    sys.exit(main(prog="eval_long_context.py"))
