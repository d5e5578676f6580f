"""hf_hilbert_attn: LongNet-style dilated attention for Hugging Face Transformers.

``import hf_hilbert_attn`` registers the attention implementation ``"hilbert_dilated"``.
"""

from .ops import dilated_attention
from .pattern import DilatedPattern
from .reference import reference_attention
from .ring import ring_attention, sequence_parallel
from .sharding import gather_sequence, shard_batch
from .integrations.cache import PatternCache, prefill
from .integrations.transformers import (ATTN_IMPLEMENTATION, DEFAULT_PATTERN, configure,
                                        get_pattern, register, set_dense_kv_heads)

register()

__version__ = "0.1.0"

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PATTERN", "DilatedPattern", "PatternCache", "configure",
           "dilated_attention", "get_pattern", "prefill", "reference_attention", "register",
           "ring_attention", "sequence_parallel", "set_dense_kv_heads", "shard_batch",
           "gather_sequence", "__version__"]
