"""Long-context evaluation and the end-to-end model benchmark.

``hf-hilbert-attn eval`` / ``examples/eval_long_context.py`` run :func:`run_eval`;
``hf-hilbert-attn bench model`` / ``examples/benchmarks/bench_model.py`` run
:mod:`hf_hilbert_attn.tools.evaluation.bench_model`. RULER-style retrieval tasks:
:mod:`~hf_hilbert_attn.tools.evaluation.ruler`; dense key/value heads chosen by calibration
(``hf-hilbert-attn calibrate``): :mod:`~hf_hilbert_attn.tools.evaluation.calibrate`; retrieval
examples for fine-tuning: :func:`retrieval_examples`.
"""

from ._args import resolve_pattern
from .passkey import evaluate_passkey, make_passkey_prompt, score_passkey
from .perplexity import evaluate_perplexity, strided_windows
from .runner import EvalConfig, run_eval
from .retrieval_train import retrieval_examples
from .ruler import evaluate_ruler

__all__ = [
    "EvalConfig",
    "run_eval",
    "resolve_pattern",
    "evaluate_perplexity",
    "strided_windows",
    "evaluate_passkey",
    "make_passkey_prompt",
    "score_passkey",
    "evaluate_ruler",
    "retrieval_examples",
]
