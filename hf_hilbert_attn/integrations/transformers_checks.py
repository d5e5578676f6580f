"""What ``hilbert_dilated`` refuses in a Transformers model, each with a one-line ``ValueError``
that says what to change: sliding-window or chunked layers, mask functions the dilated pattern
does not express, dropout, attention weights, soft-capping, learned sinks, cross-attention and
precomputed 4-D masks."""

from __future__ import annotations

import torch

try:  # Transformers' collector of per-layer outputs (``output_attentions=True`` lands here).
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - older layouts; kwargs/config are still checked
    _OUTPUT_COLLECTOR = None

SLIDING_MESSAGE = (
    "hilbert_dilated does not support sliding-window attention layers (sliding_window={window}): "
    "the dilated pattern replaces the window. Load the model with sliding_window=None "
    "(Mistral-style configs) or use_sliding_window=False (Qwen2-style configs), or use sdpa."
)

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
_MASK_WRAPPERS = {
    "and_masks.<locals>.and_mask": "mask_functions",
    "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
    "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function",
}
_UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping (softcap)",
                       "s_aux": "attention sinks (s_aux)", "sinks": "attention sinks",
                       "position_bias": "additive position bias (position_bias)"}


def check_config(cfg) -> None:
    """Refuse configs whose layers use sliding-window or chunked attention."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or ()
    if "chunked_attention" in layer_types:
        raise ValueError(CHUNKED_MESSAGE.format(size=getattr(cfg, "attention_chunk_size", None)))
    uses_window = "sliding_attention" in layer_types
    # Qwen2-style configs keep sliding_window set but inactive (use_sliding_window=False).
    active = window is not None and getattr(cfg, "use_sliding_window", True) is not False
    if uses_window or (active and not layer_types):
        raise ValueError(SLIDING_MESSAGE.format(window=window))


def _unsupported_mask_parts(fn) -> list:
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if name in _KNOWN_MASK_LEAVES:
        return []
    if name == "or_masks.<locals>.or_mask" and getattr(fn, "__closure__", None):
        # A union widens the mask (bidirectional blocks, image tokens): never ours to drop.
        inner = dict(zip(fn.__code__.co_freevars, fn.__closure__))["mask_functions"].cell_contents
        return [f"or_masks({', '.join(getattr(f, '__qualname__', repr(f)) for f in inner)})"]
    if name in _MASK_WRAPPERS and getattr(fn, "__closure__", None):
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
        inner = cells[_MASK_WRAPPERS[name]].cell_contents
        inner = inner if isinstance(inner, (tuple, list)) else (inner,)
        return [part for f in inner for part in _unsupported_mask_parts(f)]
    return [name]


def check_mask_function(mask_function, local_size=None) -> None:
    """Refuse mask functions other than causal / bidirectional / packed / padding."""
    bad = [] if mask_function is None else _unsupported_mask_parts(mask_function)
    if any("sliding" in b for b in bad):
        raise ValueError(SLIDING_MESSAGE.format(window=local_size))
    if bad:
        raise ValueError(
            f"hilbert_dilated cannot apply the mask function(s) {bad} this model adds to causal "
            "attention (chunked attention, bidirectional blocks, custom overlays); "
            "supported: causal, bidirectional, packed sequences, padding. Use sdpa for this model.")


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
    if kwargs.get("sliding_window") is not None:
        raise ValueError(SLIDING_MESSAGE.format(window=kwargs["sliding_window"]))
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
    if attention_mask is not None and attention_mask.kv_length != sk:
        raise ValueError(
            f"hilbert_dilated: the mask was built for {attention_mask.kv_length} keys but this layer "
            f"has {sk} (a sliding or otherwise different cache layer?)")
