"""hf_hilbert_attn: LongNet-style dilated attention for Hugging Face Transformers.

``import hf_hilbert_attn`` registers the attention implementation ``"hilbert_dilated"``.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PATTERN", "DilatedPattern", "PatternCache", "configure",
           "dilated_attention", "get_pattern", "prefill", "reference_attention", "register",
           "ring_attention", "sequence_parallel", "set_dense_kv_heads", "shard_batch",
           "gather_sequence", "ulysses_attention", "__version__"]


def _load() -> None:
    global dilated_attention, DilatedPattern, reference_attention, ring_attention
    global sequence_parallel, gather_sequence, shard_batch, PatternCache, prefill
    global ATTN_IMPLEMENTATION, DEFAULT_PATTERN, configure, get_pattern, register
    global set_dense_kv_heads, ulysses_attention
    from .ops import dilated_attention
    from .pattern import DilatedPattern
    from .reference import reference_attention
    from .ring import ring_attention, sequence_parallel, ulysses_attention
    from .sharding import gather_sequence, shard_batch
    from .integrations.cache import PatternCache, prefill
    from .integrations.transformers import (ATTN_IMPLEMENTATION, DEFAULT_PATTERN, configure,
                                            get_pattern, register, set_dense_kv_heads)

    register()


def _starting_the_command() -> bool:
    """Whether this process is the ``hf-hilbert-attn`` command starting (the console script, or
    ``python -m hf_hilbert_attn.tools.cli``): it parses its arguments first and loads the library
    (torch, Transformers: seconds) only after, so ``--help`` and argument errors are instant."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("hf-hilbert-attn",
                                                                 "hf-hilbert-attn.exe"):
        return True
    argv = list(getattr(_sys, "orig_argv", ()))
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "hf_hilbert_attn.tools.cli"


if _starting_the_command():
    def __getattr__(name: str):  # the library's first use: the command, once it has parsed
        if name in __all__:
            _load()
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    _load()
