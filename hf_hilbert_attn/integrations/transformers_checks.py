"""What ``hilbert_dilated`` refuses in a Transformers model, each with a one-line ``ValueError``
that says what to change: mask functions the dilated pattern does not express, a layer whose
mask or arguments apply another window or chunk than its config declares, dropout,
attention weights, per-query sinks, an additive position bias, cross-attention and
precomputed 4-D masks."""

from __future__ import annotations

import torch
from transformers import masking_utils

from .model_config import local_pattern

try:  # Transformers' collector of per-layer outputs (``output_attentions=True`` lands here).
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - older layouts; kwargs/config are still checked
    _OUTPUT_COLLECTOR = None

# Mask functions Transformers composes for plain causal / bidirectional / packed / padded
# attention, and for the windows and chunks layers keep (their cell: the size; the window kind);
# anything else (bidirectional image blocks, user overlays) changes the function.
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"
_KNOWN_MASK_LEAVES = {"causal_mask_function", "bidirectional_mask_function", _PACKED,
                      "padding_mask_function.<locals>.inner_mask"}
_LOCAL_LEAVES = {"sliding_window_overlay.<locals>.inner_mask": ("sliding_window", "sliding"),
                 "chunked_overlay.<locals>.inner_mask": ("chunk_size", "segment")}
# Before remap_positions_for_packed_sequence, Transformers counts a packed row's chunks from the
# row's first token, not each document's: another function than the chunks of positions.
_CHUNKS_BY_ROW = not hasattr(masking_utils, "remap_positions_for_packed_sequence")
_MASK_WRAPPERS = {
    "and_masks.<locals>.and_mask": "mask_functions",
    "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
    "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function",
}
_UNSUPPORTED_KWARGS = {"sinks": "attention sinks computed per query (sinks)",
                       "position_bias": "additive position bias (position_bias)"}


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


def mask_window(mask_function):
    """What a mask function adds to causal attention as a pattern (:func:`.model_config.
    local_pattern`: a ``sliding_attention`` layer's window, a ``chunked_attention`` layer's
    chunks), or None. ``ValueError`` for mask functions other than causal / bidirectional /
    packed / padding / one causal sliding window or chunking. A window or chunk size below 1
    counts as none: it would allow no key, and Transformers 5.17 makes such a mask for a layer
    type no layer has (Qwen2-MoE's sliding one, whose ``sliding_window`` is 0 when off)."""
    parts = [] if mask_function is None else _mask_parts(mask_function)
    local = [local_pattern(c[f].cell_contents, kind) for n, c in parts if n in _LOCAL_LEAVES
             for f, kind in [_LOCAL_LEAVES[n]] if c[f].cell_contents >= 1]
    bad = [n for n, _ in parts if n not in _KNOWN_MASK_LEAVES and n not in _LOCAL_LEAVES]
    if bad or len(local) > 1:
        raise ValueError(f"hilbert_dilated cannot apply the mask function(s) {bad or local} "
                         "this model adds to causal attention (bidirectional blocks, custom "
                         "overlays); supported: causal, sliding window, chunks, bidirectional, "
                         "packed sequences, padding. Use sdpa for this model.")
    if _CHUNKS_BY_ROW and local and not local[0].sliding and _PACKED in (n for n, _ in parts):
        raise ValueError("hilbert_dilated: this Transformers counts the chunks of a packed row "
                         "from the row's first token, not each document's (hilbert_dilated "
                         "restarts them with the positions): upgrade transformers, or use sdpa")
    return local[0] if local else None


def _named(local) -> str:
    return "full attention" if local is None else \
        f"{'sliding window' if local.sliding else 'chunks of'} {local.max_segment}"


def check_layer_window(module, declared, info, kwargs: dict) -> None:
    """The window or chunks a layer's config declares (:func:`.model_config.layer_window`) are
    what its mask (``info.window``) and its ``sliding_window`` argument apply (``module``: named
    in the error only, so that a compiled layer does not guard on its index)."""
    arg = kwargs.get("sliding_window")
    applied = getattr(info, "window", declared), local_pattern(arg, "sliding") if arg else declared
    if applied != (declared, declared):
        raise ValueError(f"hilbert_dilated: layer {getattr(module, 'layer_idx', '?')} applies "
                         f"{_named(applied[0])} (mask) / {_named(applied[1])} (argument), but "
                         f"its config declares {_named(declared)} (sliding_window, "
                         "attention_chunk_size, layer_types): load it with a config that says "
                         "what the layer runs, or use sdpa for it")


@torch.compiler.assume_constant_result  # a context variable: read when a layer is traced,
def _collecting_attentions() -> bool:     # not a graph break in every compiled layer
    try:
        collected = None if _OUTPUT_COLLECTOR is None else _OUTPUT_COLLECTOR.get()
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
    if kwargs.get("output_attentions") or _collecting_attentions() \
            or getattr(getattr(module, "config", None), "output_attentions", False):
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
