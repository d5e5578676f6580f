"""hf_hilbert_attn: LongNet-style dilated attention for Hugging Face Transformers.

``import hf_hilbert_attn`` registers the attention implementation ``"hilbert_dilated"``.
"""

from .ops import dilated_attention
from .pattern import DilatedPattern
from .reference import reference_attention

__version__ = "0.1.0"

__all__ = ["DilatedPattern", "dilated_attention", "reference_attention", "__version__"]
