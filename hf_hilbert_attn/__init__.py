"""hf_hilbert_attn: LongNet-style dilated attention for Hugging Face Transformers.

``import hf_hilbert_attn`` registers the attention implementation ``"hilbert_dilated"``.
"""

from .ops import dilated_attention
from .pattern import DilatedPattern
from .reference import reference_attention
from .ring import sequence_parallel
from .integrations.transformers import (
    ATTN_IMPLEMENTATION,
    DEFAULT_PATTERN,
    configure,
    get_pattern,
    register,
)

register()

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_PATTERN",
    "DilatedPattern",
    "configure",
    "dilated_attention",
    "get_pattern",
    "reference_attention",
    "register",
    "sequence_parallel",
    "__version__",
]
