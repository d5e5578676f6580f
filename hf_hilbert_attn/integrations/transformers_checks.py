"""What ``hilbert_dilated`` refuses in a Transformers model, each with a one-line ``ValueError``
that says what to change: chunked layers, mask functions the dilated pattern does not express,
a layer whose mask or arguments apply another window than its config declares, dropout,
attention weights, soft-capping, cross-attention and precomputed 4-D masks."""

from __future__ import annotations

from typing import Optional

import torch

try:  # Transformers' collector of per-layer outputs (``output_attentions=True`` lands here).
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - older layouts; kwargs/config are still checked
    _OUTPUT_COLLECTOR = None

CHUNKED_MESSAGE = (
    "hilbert_dilated does not support chunked attention layers (attention_chunk_size={size}): "
    "the dilated pattern replaces the chunks. Load the model with attention_chunk_size=None "
    "(Llama-4-style configs: every layer full attention), or use sdpa."
)

# Mask functions Transformers composes for plain causal / bidirectional / packed / padded
# attention; anything else (sliding windows, chunks, bidirectional image blocks, user overlays)
# changes the function in a way the dilated pattern does not express.
_KNOWN_MASK_LEAVES = {"causal_mask_function", "bidirectional_mask_function",
                      "packed_sequence_mask_function.<locals>.inner_mask",
                      "padding_mask_function.<locals>.inner_mask"}
_SLIDING_LEAF = "sliding_window_overlay.<locals>.inner_mask"  # (window: its closure's cell)
_MASK_WRAPPERS = {
    "and_masks.<locals>.and_mask": "mask_functions",
    "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
    "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function",
}
_UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping (softcap)",
                       "sinks": "attention sinks computed per query (sinks)",
                       "position_bias": "additive position bias (position_bias)"}


def check_config(cfg) -> None:
    """Refuse configs whose layers use chunked attention."""
    if "chunked_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise ValueError(CHUNKED_MESSAGE.format(size=getattr(cfg, "attention_chunk_size", None)))


def _mask_parts(fn) -> list:
    # The leaves under Transformers' mask combinators: (name, its closure's cells).
    name = getattr(fn, "__qualname__", type(fn).__name__)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ())) if hasattr(fn, "__code__") \
        else {}
    if name == "or_masks.<locals>.or_mask" and cells:
        # A union widens the mask (bidirectional blocks, image tokens): never ours to drop.
        inner = cells["mask_functions"].cell_contents
        return [(f"or_masks({', '.join(getattr(f, '__qualname__', repr(f)) for f in inner)})", {})]
    if name in _MASK_WRAPPERS and cells:
        inner = cells[_MASK_WRAPPERS[name]].cell_contents
        inner = inner if isinstance(inner, (tuple, list)) else (inner,)
        return [part for f in inner for part in _mask_parts(f)]
    return [(name, cells)]


def mask_window(mask_function) -> Optional[int]:
    """The sliding window a mask function adds to causal attention (a ``sliding_attention``
    layer's mask), or None. ``ValueError`` for mask functions other than causal / bidirectional
    / packed / padding / causal sliding window."""
    parts = [] if mask_function is None else _mask_parts(mask_function)
    windows = [c["sliding_window"].cell_contents for n, c in parts if n == _SLIDING_LEAF]
    bad = [n for n, _ in parts if n not in _KNOWN_MASK_LEAVES and n != _SLIDING_LEAF]
    if bad or len(windows) > 1:
        raise ValueError(f"hilbert_dilated cannot apply the mask function(s) {bad or windows} "
                         "this model adds to causal attention (chunked attention, bidirectional "
                         "blocks, custom overlays); supported: causal, sliding window, "
                         "bidirectional, packed sequences, padding. Use sdpa for this model.")
    return windows[0] if windows else None


def check_layer_window(module, declared: Optional[int], info, kwargs: dict) -> None:
    """The window a layer's config declares (:func:`.model_config.layer_window`) is the one its
    mask (``info.window``) and its ``sliding_window`` argument apply (``module``: named in the
    error only, so that a compiled layer does not guard on its index)."""
    applied = getattr(info, "window", declared), kwargs.get("sliding_window") or declared
    if applied != (declared, declared):
        raise ValueError(f"hilbert_dilated: layer {getattr(module, 'layer_idx', '?')} "
                         f"applies sliding window {applied[0]} (mask) / {applied[1]} (argument), "
                         f"but its config declares {declared or 'full attention'} "
                         "(sliding_window, layer_types): load it with a config that says what "
                         "the layer runs, or use sdpa for it")


@torch.compiler.assume_constant_result  # a context variable: read when a layer is traced,
def _collecting_attentions() -> bool:     # not a graph break in every compiled layer
    if _OUTPUT_COLLECTOR is None:
        return False
    try:
        collected = _OUTPUT_COLLECTOR.get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


def check_call(module, dropout: float, causal: bool, batch: int, sq: int, sk: int,
               attention_mask, mask_type: type, kwargs: dict) -> None:
    """Refuse what one layer call asks for and the op cannot give."""
    if dropout and dropout > 0:
        raise ValueError(
            f"hilbert_dilated does not support attention dropout (got dropout={dropout} in training); "
            "set the config's attention dropout to 0 (attention_dropout, attn_pdrop for GPT-2) or "
            "call model.eval()")
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False) \
            or _collecting_attentions():
        raise ValueError(
            "hilbert_dilated does not compute attention weights, so output_attentions=True is not "
            "supported; use attn_implementation='eager' to inspect attention weights")
    for key, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"hilbert_dilated does not support {what}; use sdpa or eager for this model")
    # Cross-attention: GPT-2 flags it; Bart-style decoders use is_decoder with is_causal=False.
    cross = getattr(module, "is_cross_attention", False) or (
        not causal and getattr(module, "is_decoder", False))
    if cross or (not causal and sq != sk):
        raise ValueError(
            f"hilbert_dilated supports self-attention only, not cross-attention (queries {sq} vs "
            f"keys {sk} from another sequence); use sdpa for this model")
    if attention_mask is not None and not isinstance(attention_mask, mask_type):
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(
            f"hilbert_dilated got a precomputed attention mask of shape {shape}; it needs the 2-D "
            "padding mask [B, S] that the model turns into its own compact description. Pass "
            "attention_mask as [B, S] (custom 4-D masks are not supported)")
    if kwargs.get("hilbert_doc_ids") is None and kwargs.get("cu_seq_lens_q") is not None \
            and (batch != 1 or sq != sk):  # paged caches (continuous batching) send them too
        raise ValueError("hilbert_dilated does not support paged / continuous-batching attention "
                         f"(cu_seq_lens with batch {batch}, {sq} queries, {sk} keys); use generate()")
    if attention_mask is not None and attention_mask.kv_offset and \
            attention_mask.padding_mask is not None:
        raise ValueError("PatternCache does not support padded batches (every row must hold real "
                         "tokens only): generate row by row, or use a DynamicCache")
    if attention_mask is not None and attention_mask.kv_length != sk:
        raise ValueError(
            f"hilbert_dilated: the mask was built for {attention_mask.kv_length} keys but this layer "
            f"has {sk} (a sliding or otherwise different cache layer?)")
