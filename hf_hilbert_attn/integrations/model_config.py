"""The pattern a model carries in ``config.hilbert_attn`` (a dict, saved in ``config.json``), and
the once-per-process notes about it. Below both the attention functions
(:mod:`.transformers`) and the cache (:mod:`.cache`), which read the pattern the same way.
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import warnings
from typing import Optional

import torch

from ..pattern import DilatedPattern, replaced
from ..patterns import as_pattern

ATTN_IMPLEMENTATION = "hilbert_dilated"

# config.hilbert_attn's per-layer entry: one list of dense key/value heads per decoder layer
# (a calibration's choice, docs/retrieval.md "Dense key/value heads"); beside the pattern's own
# fields.
LAYER_DENSE = "layer_dense_kv_heads"

_NOTES = {
    "default": "hf_hilbert_attn: this model's config has no 'hilbert_attn' pattern, so it uses "
    "the default (patterns/default.yaml: dense up to 2048 tokens, then sliding dilated windows up "
    "to 64K and one sink token). Measured on a trained 135M model it stays within 2.3 % of dense "
    "perplexity up to 8K tokens, but exact retrieval of a detail more than 2048 tokens back "
    "degrades (passkey 12/20 at 4K, 4/20 at 8K) unless some heads stay dense: `hf-hilbert-attn "
    "calibrate MODEL_DIR` chooses them in about a second on a GPU, ten minutes on a 2-core CPU "
    "(20/20 and 14/20 there). Call "
    "hf_hilbert_attn.configure(model, pattern) to choose a pattern ('dense' for exact attention; "
    "the shipped ones: hf_hilbert_attn.patterns.names(), each drawn by `hf-hilbert-attn "
    "show-pattern NAME`).",
    "unused": "hf_hilbert_attn: this model's config has a 'hilbert_attn' pattern but the model runs "
    "{attn} (Transformers does not save the attention implementation; from_pretrained without "
    "attn_implementation picks sdpa): dense attention, not the pattern. Load it with "
    "attn_implementation='hilbert_dilated' to use the pattern.",
}
_NOTED = set()

# A note names the user's line: the first caller outside this package, Python's own library and
# the installed ones (a forward passes through a dozen frames of torch, transformers and what they
# hook in, such as the kernels package; a fixed stacklevel or list of packages lands in one).
_INTERNAL = tuple({os.path.join(p, "") for p in (
    os.path.dirname(os.path.dirname(__file__)), site.getusersitepackages(), *site.getsitepackages(),
    *(sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")))})


def note_once(key: str, **fields) -> None:
    # Once per process, and not while torch.compile traces (the eager first call says it).
    if key in _NOTED or torch.compiler.is_compiling():
        return
    _NOTED.add(key)
    level, frame = 2, sys._getframe(1)  # 1: note_once, 2: its caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        level, frame = level + 1, frame.f_back
    warnings.warn(_NOTES[key].format(**fields), UserWarning, stacklevel=level)


def reset_notes() -> None:
    """Let each once-per-process note be said again (tests)."""
    _NOTED.clear()


# The local attention a layer type keeps exactly: its config field (the size), its window kind.
LOCAL_LAYERS = {"sliding_attention": ("sliding_window", "sliding"),
                "chunked_attention": ("attention_chunk_size", "segment")}


@functools.lru_cache(maxsize=64)
def local_pattern(size: int, window: str) -> DilatedPattern:
    """``[(size, 1)]``: a sliding window (``window="sliding"``) or chunks (``"segment"``)."""
    return DilatedPattern([size], [1], window=window)


def layer_window(config, layer_idx: Optional[int]) -> Optional[DilatedPattern]:
    """What layer ``layer_idx`` of a model with this config keeps exactly (:func:`local_pattern`)
    or None for a full-attention layer (and for ``layer_idx`` None): a ``"sliding_attention"``
    layer its ``sliding_window``, a ``"chunked_attention"`` layer its ``attention_chunk_size``.
    Without ``layer_types``, every layer keeps an active window (Mistral-style; Qwen2-style
    ``use_sliding_window=False`` turns it off), else chunks, as Transformers reads it."""
    types = getattr(config, "layer_types", None)
    if layer_idx is None or getattr(config, "use_sliding_window", 1) is False:
        return None
    for kind, (field, window) in LOCAL_LAYERS.items():
        if getattr(config, field, None) is not None and (not types or types[layer_idx] == kind):
            return local_pattern(getattr(config, field), window)
    return None


def layers_differ(config) -> bool:
    """True when the layers of a model with this config run different patterns: a calibration's
    per-layer dense heads, or sliding-window or chunked layers (:func:`layer_window`)."""
    raw, types = getattr(config, "hilbert_attn", None), getattr(config, "layer_types", None)
    return (isinstance(raw, dict) and LAYER_DENSE in raw) or any(
        layer_window(config, i) is not None for i in range(len(types or [None])))


def get_pattern(config, layer_idx: Optional[int] = None) -> DilatedPattern:
    """The pattern a model with this config uses in layer ``layer_idx``: ``config.hilbert_attn``,
    else the default (:data:`DEFAULT_PATTERN`, ``patterns/default.yaml``; said once, with its
    cost). A sliding-window or chunked layer (:func:`layer_window`) keeps exactly its window
    or chunk ``w``: the pattern ``[(w, 1)]``, no sinks, no dense heads. A per-layer list of
    dense key/value heads (:func:`set_dense_kv_heads`) replaces the pattern's own
    ``dense_kv_heads`` in its layer (``layer_idx`` None: the shared pattern)."""
    raw = getattr(config, "hilbert_attn", None)
    if raw is not None and not isinstance(raw, (dict, DilatedPattern)):
        raise TypeError(f"config.hilbert_attn must be a dict (DilatedPattern.to_dict()), got "
                        f"{type(raw).__name__}: {raw!r}")
    if raw is None:
        note_once("default")
    if (local := layer_window(config, layer_idx)) is not None:
        return local
    if not isinstance(raw, dict) or LAYER_DENSE not in raw:
        return as_pattern(raw)
    layers = raw[LAYER_DENSE]
    base = as_pattern({k: v for k, v in raw.items() if k != LAYER_DENSE})
    if layer_idx is None:
        return base
    if not isinstance(layers, (list, tuple)) or not 0 <= layer_idx < len(layers):
        raise ValueError(f"config.hilbert_attn[{LAYER_DENSE!r}] must list the dense key/value "
                         f"heads of every layer; layer {layer_idx} is missing (got {layers!r})")
    return replaced(base, base.ordering, dense_kv_heads=tuple(layers[layer_idx]))


def sharding_pattern(config) -> DilatedPattern:
    """What ``sharding.resolve_layout`` decides ``"auto"`` by: the shared pattern, with the dense
    key/value heads of any layer (a calibration's: their ring is causal attention, D46)."""
    raw, base = getattr(config, "hilbert_attn", None), get_pattern(config)
    layers = raw.get(LAYER_DENSE) if isinstance(raw, dict) else None
    heads = sorted({h for layer in layers or () for h in layer})
    return base.replace(dense_kv_heads=heads) if heads and not base.dense_kv_heads else base
