"""A KV cache bounded by the pattern, and chunked prefill, for ``hilbert_dilated`` generation
(guide: ``docs/usage.md``, "Generation with a bounded cache").

A causal query at ``p`` never attends a key older than :meth:`DilatedPattern.first_needed_key`
of ``p`` unless it is a sink, and that bound only moves forward. :class:`PatternCache`
(Transformers' ``Cache`` API) therefore keeps per layer the sinks and the keys from
``first_needed_key(next position)`` (rounded down to the pattern's shift period, so the kernels
run in natural order) on: ``sink_tokens + cache_reach()`` keys, not the sequence, and the same
function as a ``DynamicCache``.

Layout ``[sinks | tail]``: slot ``j < sink_tokens`` holds position ``j``, later slots position
``j + dropped`` (``get_mask_sizes``' ``kv_offset``); the layer attends the tail with the pattern
and the sinks densely, merged by log-sum-exp (:func:`attend_with_dropped_keys`). Padded rows
raise once keys are dropped.
"""

from __future__ import annotations

import functools
import inspect
from typing import Iterator, Optional, Tuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..numerics import merge_partials
from ..ops import dilated_attention
from ..pattern import DilatedPattern
from ..patterns import as_pattern
from .model_config import (ATTN_IMPLEMENTATION, get_pattern, layer_window, layers_differ,
                           note_once, replaced)

__all__ = ["PatternCache", "PatternCacheLayer", "prefill", "prefill_chunks", "cache_kwarg",
           "attend_with_dropped_keys", "DEFAULT_PREFILL_CHUNK", "uses_pattern_attention"]

DEFAULT_PREFILL_CHUNK = 16384  # tokens per forward of a chunked prefill


# A layer on a GPU concatenates, as a DynamicLayer, while it holds fewer bytes of keys and values
# than this (its host work is less), and keeps room for them above (the copy outlasts a step): D82
ROOM_BYTES = 1 << 29


@functools.lru_cache(maxsize=8)  # every layer asks for the same position in turn
def _keep_from(pattern: DilatedPattern, position: int, num_heads, align: int) -> int:
    return pattern.first_needed_key(position, num_heads) // align * align


class PatternCacheLayer(DynamicLayer):
    """One layer of :class:`PatternCache`: a ``DynamicLayer`` that drops the keys no later query
    can attend under ``pattern`` (see the module docstring for the layout)."""

    is_sliding = False  # masks are built for it like for a full-attention layer
    is_croppable = False  # dropped keys cannot come back (assisted decoding refuses it)

    def __init__(self, pattern: DilatedPattern, num_heads: Optional[int] = None,
                 align: Optional[int] = None, **kwargs):
        super().__init__()
        self.pattern, self.num_heads = pattern, num_heads
        period = pattern.shift_period
        self.align = (period if period <= pattern.max_segment else 1) if align is None else align
        self.cumulative_length = 0  # tokens seen: the next query's position
        self.dropped = 0  # positions dropped after the sinks
        self._room = None  # where appended keys go (_append)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys/values and return all (this step attends them); keep only those
        a later query can attend."""
        keys, values = self._append(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if self.pattern.dense_kv_heads:  # a dense head attends every key: drop none
            return keys, values
        sinks = self.pattern.sink_tokens
        start = _keep_from(self.pattern, self.cumulative_length, self.num_heads, self.align)
        cut = max(0, start - sinks) - self.dropped
        if cut > 0:  # slots [sinks, sinks + cut) hold the keys to drop
            self._store([(t[..., :sinks, :], t[..., sinks + cut:, :]) for t in (keys, values)],
                        room=self._room is not None)
            self.dropped += cut
        return keys, values

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``self.keys`` / ``self.values`` with ``k`` / ``v`` appended: concatenated as a
        DynamicLayer on a GPU below ``ROOM_BYTES`` (keys and values: about twice the keys),
        where a gradient is recorded (keys written once are never overwritten) or where
        ``torch.compile`` traces (addresses are the eager step's); else written into room kept
        after them, so that a step copies its own keys and not the stored ones (where there is no
        such room: the first call, after a reorder, or room made under ``torch.inference_mode``
        when this step is not: :meth:`_store`). ``_room`` holds the buffers' addresses, strides
        and length, not the buffers."""
        if k.is_cuda and (self.keys is None or 2 * self.keys.numel() * k.element_size()
                          < ROOM_BYTES) or torch.compiler.is_compiling() or \
                torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            self._room = None  # (checked first: a step then costs what a DynamicLayer's does)
            return super().update(k, v)
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        n, m, room, kv = self.stored_tokens, k.shape[-2], self._room, (self.keys, self.values)
        if room is None or n + m > room[1] or room[0] != tuple(
                (t.data_ptr(), t.stride()) for t in kv) or (
                self.keys.is_inference() and not torch.is_inference_mode_enabled()):
            self._store([(self.keys, k), (self.values, v)] if n else [(k,), (v,)])
        else:  # (as_strided: the stored part of the buffers, grown by m rows)
            self.keys, self.values = (t.as_strided((*t.shape[:-2], n + m, t.shape[-1]),
                                                   t.stride()) for t in kv)
            self.keys.narrow(-2, n, m).copy_(k)
            self.values.narrow(-2, n, m).copy_(v)
        return self.keys, self.values

    def _store(self, parts, room: bool = True) -> None:
        """Store the keys and the values ``parts`` (``[key parts, value parts]``), each
        concatenated along the tokens into a new buffer with room kept after them (a sixteenth
        of them, at least 256 slots), or plainly (not ``room``: a cut where the layer
        concatenates, :meth:`_append`)."""
        if not room:
            self.keys, self.values, self._room = *(torch.cat(p, -2) for p in parts), None
            return
        n = sum(x.shape[-2] for x in parts[0])
        cap = n + max(256, n // 16)  # (values may be narrower than keys: MLA)
        bufs = [p[0].new_empty((*p[0].shape[:-2], cap, p[0].shape[-1])) for p in parts]
        self.keys, self.values = (torch.cat(p, -2, out=b.narrow(-2, 0, n))
                                  for p, b in zip(parts, bufs))
        self._room = (tuple((b.data_ptr(), b.stride()) for b in bufs), cap)

    def get_mask_sizes(self, query_length: int, *args) -> Tuple[int, int]:
        """``(keys this step attends, dropped positions)``: the second is the ``kv_offset`` the
        mask function receives (slot ``j >= sink_tokens`` is position ``j + kv_offset``)."""
        return self.stored_tokens + query_length, self.dropped

    @property
    def stored_tokens(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_seq_length(self, *args) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        if self.dropped:
            raise ValueError("a PatternCache that has dropped keys cannot be cropped (assisted "
                             "decoding, contrastive search): use a DynamicCache for those")
        super().crop(tokens_to_remove)
        self.cumulative_length = self.stored_tokens

    def reset(self) -> None:
        self.keys = self.values = self._room = None
        self.is_initialized = False
        self.cumulative_length = self.dropped = 0


class PatternCache(Cache):
    """A KV cache whose memory is bounded by the dilated pattern, not by the sequence.

    Args:
        model: a model (or its config) that runs ``hilbert_dilated``: the pattern, the number of
            layers and of query heads come from its config. Or give them:
        pattern: a :class:`DilatedPattern` (or anything ``configure`` accepts); default the
            model's.
        num_layers: decoder layers (default: the config's; else layers are added as used).
        num_heads: query heads, so that per_head classes no head uses are not kept (default:
            the config's; None keeps every class).
        align: keep from a multiple of this (default: the pattern's shift period where it is
            at most the longest segment, so the attention stays on the kernels' fast path).

    ``max_stored_tokens`` bounds the keys a layer stores between steps, except in layers with
    dense key/value heads, which keep every key. Works with ``generate(past_key_values=...)``
    and :func:`prefill`; rows must not be padded.
    """

    def __init__(self, model=None, *, pattern=None, num_layers: Optional[int] = None,
                 num_heads: Optional[int] = None, align: Optional[int] = None):
        config = getattr(model, "config", model)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        attn = getattr(config, "_attn_implementation", None)
        if attn is not None and attn != "hilbert_dilated":
            raise ValueError(f"PatternCache needs attn_implementation='hilbert_dilated' (this "
                             f"model runs {attn!r}, which would read the dropped keys' slots as "
                             f"positions): use a DynamicCache, or hf_hilbert_attn.configure(model)")
        if pattern is None:
            if config is None:
                raise ValueError("PatternCache needs a model (or config) or a pattern")
            pattern = get_pattern(config)
        self.pattern = as_pattern(pattern)
        num_layers = num_layers or getattr(config, "num_hidden_layers", None)
        num_heads = num_heads or getattr(config, "num_attention_heads", None)
        make = functools.partial(PatternCacheLayer, self.pattern, num_heads, align)
        per_layer = layers_differ(config) and self.pattern == get_pattern(config)
        if per_layer and not num_layers:
            raise ValueError("PatternCache: this model's layers run different patterns; pass "
                             "num_layers (or a config with num_hidden_layers)")
        if num_layers:  # each layer its own pattern: a calibration's dense heads, a window, chunks
            super().__init__(layers=[
                PatternCacheLayer(get_pattern(config, i), num_heads, align) if per_layer else make()
                for i in range(num_layers)])
            for i, layer in enumerate(self.layers):  # masks: Transformers' sliding / chunked ones
                layer.is_sliding = per_layer and layer_window(config, i) is not None
        else:
            super().__init__(layer_class_to_replicate=make)
        probe = make()
        self.align, self.num_heads = probe.align, num_heads
        kinds = {(x.pattern, x.align) for x in [probe, *self.layers]}  # (each once: a scan)
        self.max_stored_tokens = max(p.sink_tokens + p.cache_reach(num_heads, a) for p, a in kinds)

    def stored_tokens(self, layer_idx: int = 0) -> int:
        """Keys (per row and head) that layer ``layer_idx`` stores now."""
        return self.layers[layer_idx].stored_tokens if layer_idx < len(self.layers) else 0


# --------------------------------------------------------------------------------- attention
def attend_with_dropped_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             pattern: DilatedPattern, *, q_start: int, dropped: int,
                             causal: bool = True, scale: Optional[float] = None,
                             backend: str = "auto", return_lse: bool = False,
                             softcap: Optional[float] = None):
    """Dilated attention over a :class:`PatternCache` layer that dropped ``dropped`` positions
    after the sinks: ``key``/``value`` ``[B, Hkv, Sk, D]`` hold positions ``0..sinks-1`` then
    ``sinks + dropped ..``, ending with the queries' own keys; the ``Sq`` queries sit at
    ``q_start ..``. Returns ``[B, Hq, Sq, D]``: the tail with the pattern minus its sinks
    (natural order, shifted, where its first position is a multiple of the shift period),
    the sinks as a dense softmax, merged by log-sum-exp; with ``return_lse`` also the merged
    log-sum-exp ``[B, Hq, Sq]`` (float32); ``softcap`` as in ``dilated_attention``.
    """
    if not causal:
        raise ValueError("a PatternCache serves causal decoding only (got a non-causal layer)")
    sinks, (b, hq, sq, d), (hkv, sk) = pattern.sink_tokens, query.shape, key.shape[1:3]
    first = sinks + dropped  # the tail's first position
    if first + sk - sinks != q_start + sq:
        raise ValueError(f"PatternCache layout mismatch: {sk} keys (tail from {first}) for "
                         f"queries at {q_start}..{q_start + sq - 1}")
    body = replaced(pattern, pattern.ordering, sink_tokens=0)
    positions = {}
    if first % pattern.shift_period:  # not a shift of the natural order: say where they are
        positions = dict(q_positions=torch.arange(q_start, q_start + sq, device=query.device),
                         k_positions=torch.arange(first, q_start + sq, device=query.device))
    out, lse = dilated_attention(query, key[:, :, sinks:], value[:, :, sinks:], body, causal=True,
                                 scale=scale, return_lse=True, backend=backend, softcap=softcap,
                                 **positions)
    if not sinks:
        return (out, lse) if return_lse else out
    scale = d ** -0.5 if scale is None else scale
    with torch.autocast(query.device.type, enabled=False):  # float32, as the op's lse
        q = query.reshape(b, hkv, (hq // hkv) * sq, d).float()  # head h reads kv head h // (hq/hkv)
        scores = torch.matmul(q, key[:, :, :sinks].float().transpose(-1, -2)) * scale
        scores = scores if not softcap else torch.tanh(scores / softcap) * softcap
        sink_lse = torch.logsumexp(scores, dim=-1)
        sink_out = torch.matmul(torch.exp(scores - sink_lse[..., None]),
                                value[:, :, :sinks].float())
        merged, lse = merge_partials(out.float(), lse.float(), sink_out.reshape(b, hq, sq, -1),
                                     sink_lse.reshape(b, hq, sq))
    return (merged.to(out.dtype), lse) if return_lse else merged.to(out.dtype)


# --------------------------------------------------------------------------------- prefill
def cache_kwarg(model) -> str:
    """The name ``model``'s forward (and ``generate``) takes the cache by: ``"cache"`` from
    transformers 5.2x on, ``"past_key_values"`` before (the old name still works, deprecated)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def uses_pattern_attention(model) -> bool:
    """True if ``model`` runs ``hilbert_dilated`` attention (so a :class:`PatternCache` fits)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def _default_cache(model) -> Cache:
    if uses_pattern_attention(model):
        return PatternCache(model)
    if getattr(model.config, "hilbert_attn", None) is not None:  # saved with us, loaded without
        note_once("unused", attn=getattr(model.config, "_attn_implementation", None))
    return DynamicCache(config=model.config)


@torch.inference_mode()
def prefill_chunks(model, input_ids: torch.Tensor, *, chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
                   cache: Optional[Cache] = None, logits_from: Optional[int] = None
                   ) -> Iterator[Tuple[int, int, Optional[torch.Tensor]]]:
    """Feed ``input_ids`` ``[B, S]`` through ``model`` ``chunk_tokens`` at a time, extending
    ``cache`` (default: a :class:`PatternCache` for ``hilbert_dilated`` models, else a
    ``DynamicCache``; a non-empty cache continues where it stands).

    Yields ``(begin, end, logits)`` per chunk: the logits ``[B, n, V]`` at positions
    ``max(begin, logits_from) .. end - 1`` of ``input_ids``, or None (``logits_from`` None or
    after ``end``: only the last position's logits are computed).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, S] with S >= 1, got {tuple(input_ids.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    cache = _default_cache(model) if cache is None else cache
    device = next(model.parameters()).device
    for begin in range(0, input_ids.shape[1], chunk_tokens):
        end = min(begin + chunk_tokens, input_ids.shape[1])
        keep = 0 if logits_from is None else end - max(begin, logits_from)
        out = model(input_ids=input_ids[:, begin:end].to(device), **{cache_kwarg(model): cache},
                    use_cache=True, logits_to_keep=max(keep, 1))
        yield begin, end, (out.logits[:, -keep:] if keep > 0 else None)


def prefill(model, input_ids: torch.Tensor, *, chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
            cache: Optional[Cache] = None) -> Cache:
    """Run the prompt ``input_ids`` ``[B, S]`` through ``model`` in chunks of ``chunk_tokens``
    and return the filled cache (see :func:`prefill_chunks`). Continue with
    ``model.generate(ids_with_one_more_token, attention_mask=..., past_key_values=cache)``:
    generate feeds only the tokens the cache has not seen."""
    cache = _default_cache(model) if cache is None else cache
    for _ in prefill_chunks(model, input_ids, chunk_tokens=chunk_tokens, cache=cache):
        pass
    return cache
