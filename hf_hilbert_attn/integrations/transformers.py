"""``attn_implementation="hilbert_dilated"``: the attention and mask functions for Transformers.

Transformers calls two hooks per forward (``masking_utils.create_causal_mask`` → the registered
*mask* function, once; then the registered *attention* function, once per layer):

* :func:`hilbert_dilated_mask` never builds an ``[B, 1, Sq, Sk]`` mask. It returns a small
  :class:`DilatedMaskInfo` (the 2-D padding mask, if any, and where the queries sit in the KV
  cache) that every layer of that forward shares.
* :func:`hilbert_dilated_attention_forward` turns it, with ``position_ids``, into the true positions
  and document ids of queries and keys and calls :func:`hf_hilbert_attn.dilated_attention` (or
  :func:`hf_hilbert_attn.ring.ring_attention` inside :func:`hf_hilbert_attn.sequence_parallel`).

Positions the pattern sees (DESIGN §1: true positions, not storage indices):

* no cache (training, prefill): ``position_ids``; a position that does not follow its
  predecessor by 1 starts a new document (packed sequences, as ``DataCollatorWithFlattening``
  makes them), the rule ``masking_utils.find_packed_sequence_indices`` uses;
* with a cache (decode, static-cache prefill): key ``j`` of sample ``b`` sits at
  ``cumsum(attention_mask[b])[j] - 1`` (left padding shifts nothing), or at ``j`` without a
  padding mask; the queries are the cache slots ``q_offset ..`` they were written to. Generate's
  ``position_ids`` are the same numbers, computed from the same mask.

Padded keys (and empty static-cache slots) are never attended. The model's pattern lives in
``config.hilbert_attn`` (a dict, saved in ``config.json``); see :func:`configure`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional, Union

import torch
import transformers
from packaging import version
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..ops import dilated_attention
from ..pattern import DilatedPattern
from ..patterns import DEFAULT_PATTERN, as_pattern
from .. import ring as _ring

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_PATTERN",
    "DilatedMaskInfo",
    "configure",
    "get_pattern",
    "hilbert_dilated_attention_forward",
    "hilbert_dilated_mask",
    "register",
]

ATTN_IMPLEMENTATION = "hilbert_dilated"

DEFAULT_PATTERN_NOTE = (
    "hf_hilbert_attn: this model's config has no 'hilbert_attn' pattern, so it uses the default "
    "(hf_hilbert_attn/patterns/default.yaml: dense up to 2048 tokens, then sliding dilated windows up to 64K and one "
    "sink token). Measured on a trained 135M model it stays within 2.3 % of dense perplexity up to "
    "8K tokens, but exact retrieval of a detail more than 2048 tokens back degrades (passkey 17/30 at "
    "4K, 6/30 at 8K). Call hf_hilbert_attn.configure(model, pattern) to choose one "
    "(hf_hilbert_attn/patterns/dense.yaml for exact attention); docs/usage.md, 'Choosing a pattern'."
)

# Checked once at import. The hooks used here (AttentionInterface, AttentionMaskInterface and
# its keyword arguments, the output collector) are the same from 5.17 to 5.24.
_TRANSFORMERS_VERSION = version.parse(transformers.__version__)
if _TRANSFORMERS_VERSION < version.parse("5.0"):
    raise ImportError(
        f"hf_hilbert_attn needs transformers>=5.0 (AttentionMaskInterface), found {transformers.__version__}"
    )

try:  # Transformers' collector of per-layer outputs (``output_attentions=True`` lands here).
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - older layouts; kwargs/config are still checked
    _OUTPUT_COLLECTOR = None


# ----------------------------------------------------------------------------------- pattern
def get_pattern(config) -> DilatedPattern:
    """The pattern a model with this config uses: ``config.hilbert_attn``, else :data:`DEFAULT_PATTERN`.

    Cached per distinct dict, so calling it in every layer costs a dict walk.
    """
    raw = getattr(config, "hilbert_attn", None)
    if raw is not None and not isinstance(raw, (dict, DilatedPattern)):
        raise TypeError(
            f"config.hilbert_attn must be a dict (DilatedPattern.to_dict()), got {type(raw).__name__}: {raw!r}"
        )
    if raw is None:
        _note_default()
    return as_pattern(raw)


_DEFAULT_NOTED = [False]


def _note_default() -> None:
    # Once per process: a user who switched a model to hilbert_dilated without choosing a
    # pattern hears what the default costs in quality (and how to choose). Not while
    # torch.compile traces (the eager first call says it).
    if _DEFAULT_NOTED[0] or torch.compiler.is_compiling():
        return
    _DEFAULT_NOTED[0] = True
    import warnings

    warnings.warn(DEFAULT_PATTERN_NOTE, UserWarning, stacklevel=4)


@lru_cache(maxsize=64)
def _natural(pattern: DilatedPattern) -> DilatedPattern:
    # The op receives tokens already in storage order with their positions; it must not
    # permute again.
    return pattern if pattern.ordering == "natural" else pattern.replace(ordering="natural")


def configure(model, pattern: Union[DilatedPattern, dict, str, os.PathLike, None] = None, *,
              set_attn_implementation: bool = True):
    """Give ``model`` a dilated attention pattern, stored where ``save_pretrained`` keeps it.

    Writes ``pattern.to_dict()`` to ``model.config.hilbert_attn`` and to the config of every
    sub-model (composite models), so ``config.json`` carries it and ``from_pretrained`` restores it.

    Args:
        model: a ``transformers.PreTrainedModel``.
        pattern: a :class:`DilatedPattern`, its dict, a YAML path (e.g. ``hf_hilbert_attn/patterns/longnet_lm.yaml``),
            or ``None`` for :data:`DEFAULT_PATTERN`.
        set_attn_implementation: also call ``model.set_attn_implementation("hilbert_dilated")``.

    Returns:
        ``model`` (changed in place).

    Raises:
        ValueError: invalid pattern, or a config with sliding-window attention (unsupported).
        TypeError: ``model`` has no ``config``.
    """
    pattern = as_pattern(pattern)
    if not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    configs = {id(model.config): model.config}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if isinstance(cfg, transformers.PretrainedConfig):
            configs.setdefault(id(cfg), cfg)
    for cfg in configs.values():
        _check_config(cfg)
    for cfg in configs.values():
        cfg.hilbert_attn = pattern.to_dict()
    if set_attn_implementation:
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _check_config(cfg) -> None:
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or ()
    uses_window = any(t in ("sliding_attention", "chunked_attention") for t in layer_types)
    # Qwen2-style configs keep sliding_window set but inactive (use_sliding_window=False).
    active = window is not None and getattr(cfg, "use_sliding_window", True) is not False
    if uses_window or (active and not layer_types):
        raise ValueError(_SLIDING_MESSAGE.format(window=window))


_SLIDING_MESSAGE = (
    "hilbert_dilated does not support sliding-window attention layers (sliding_window={window}): "
    "the dilated pattern replaces the window. Load the model with sliding_window=None "
    "(Mistral-style configs) or use_sliding_window=False (Qwen2-style configs), or use sdpa."
)


# --------------------------------------------------------------------------------- the mask
@dataclass(eq=False)
class DilatedMaskInfo:
    """The compact "mask" every layer of one forward receives (instead of ``[B, 1, Sq, Sk]``).

    Attributes:
        q_offset: cache slot of the first query (int, or a 0-d tensor for static caches).
        q_length, kv_length: query / key lengths the layers will see.
        padding_mask: ``[B, kv_length]`` bool, True = a real token; ``None`` when every key
            slot holds a real token.
    """

    q_offset: Any
    q_length: int
    kv_length: int
    padding_mask: Optional[torch.Tensor] = None
    # Positions / document ids derived in the first layer, reused by the others.
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def ndim(self) -> int:
        # generate() builds masks ahead of the forward (static caches) and passes them back in as
        # ``attention_mask``; masking_utils then reads ``.ndim`` and treats anything but a 2-D
        # padding mask as prepared. We stand for the 4-D mask of other implementations.
        return 4


# Mask functions Transformers composes for plain causal / bidirectional / packed / padded
# attention; anything else (sliding windows, chunks, bidirectional image blocks, user overlays)
# changes the function in a way the dilated pattern does not express.
_KNOWN_MASK_LEAVES = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "packed_sequence_mask_function.<locals>.inner_mask",
    "padding_mask_function.<locals>.inner_mask",
}
_MASK_WRAPPERS = {
    "and_masks.<locals>.and_mask": "mask_functions",
    "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
    "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function",
}


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


def hilbert_dilated_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> DilatedMaskInfo:
    """``AttentionMaskInterface`` entry: describe the mask in O(B·Sk) instead of building it.

    Args mirror ``transformers.masking_utils.sdpa_mask``; ``attention_mask`` is the 2-D padding
    mask ``[B, past + Sq]`` (or None).

    Returns:
        A :class:`DilatedMaskInfo`.

    Raises:
        ValueError: for mask functions other than causal / bidirectional / packed / padding
            (sliding windows, chunked attention, block overlays).
    """
    if isinstance(attention_mask, DilatedMaskInfo):
        return attention_mask  # prepared by generate() for this very step
    if mask_function is not None:
        bad = _unsupported_mask_parts(mask_function)
        if bad:
            if any("sliding" in b for b in bad):
                raise ValueError(_SLIDING_MESSAGE.format(window=kwargs.get("local_size")))
            raise ValueError(
                f"hilbert_dilated cannot apply the mask function(s) {bad} this model adds to causal "
                "attention (chunked attention, bidirectional blocks, custom overlays); "
                "supported: causal, bidirectional, packed sequences, padding. Use sdpa for this model."
            )
    padding = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"hilbert_dilated expects a 2-D padding mask [B, S], got shape {tuple(attention_mask.shape)}"
            )
        padding = attention_mask.to(torch.bool)
        # The 2-D mask covers the tokens seen so far; a static cache has more (empty) slots:
        # they are padding. kv_offset > 0 only for sliding caches, rejected above.
        missing = kv_offset + kv_length - padding.shape[-1]
        if missing > 0:
            padding = torch.nn.functional.pad(padding, (0, missing), value=False)
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if bool(padding.all()):  # one host sync per forward, as flash_attention_mask does
            padding = None
    if isinstance(q_offset, torch.Tensor):
        # A static cache hands out its own step counter, which the first layer's cache update
        # advances in place before our attention runs: keep the value of this step.
        q_offset = q_offset.clone()
    return DilatedMaskInfo(q_offset=q_offset, q_length=q_length, kv_length=kv_length,
                           padding_mask=padding)


# ----------------------------------------------------------------------------- the attention
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping (softcap)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "additive position bias (position_bias)",
}


def _collecting_attentions() -> bool:
    if _OUTPUT_COLLECTOR is None:
        return False
    try:
        collected = _OUTPUT_COLLECTOR.get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


def _check_call(module, dropout: float, kwargs: dict) -> None:
    if dropout and dropout > 0:
        raise ValueError(
            f"hilbert_dilated does not support attention dropout (got dropout={dropout} in training); "
            "set the config's attention dropout to 0 (attention_dropout, attn_pdrop for GPT-2) or "
            "call model.eval()"
        )
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False) \
            or _collecting_attentions():
        raise ValueError(
            "hilbert_dilated does not compute attention weights, so output_attentions=True is not "
            "supported; use attn_implementation='eager' to inspect attention weights"
        )
    window = kwargs.get("sliding_window")
    if window is not None:
        raise ValueError(_SLIDING_MESSAGE.format(window=window))
    for key, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"hilbert_dilated does not support {what}; use sdpa or eager for this model")


def _restart_doc_ids(pos: torch.Tensor) -> Optional[torch.Tensor]:
    """Document ids ``[Bp, S]`` from positions that restart per document, or None for one document."""
    new_doc = torch.diff(pos, dim=-1) != 1  # [Bp, S-1]
    if not bool(new_doc.any()):
        return None
    return torch.nn.functional.pad(new_doc, (1, 0), value=False).cumsum(-1)


@dataclass
class _Layout:
    """True positions / document ids of one layer call (None = the op's natural default)."""

    q_pos: Optional[torch.Tensor]
    k_pos: Optional[torch.Tensor]
    q_doc: Optional[torch.Tensor]
    k_doc: Optional[torch.Tensor]
    plain: bool  # self-attention over positions 0..S-1 (Hilbert storage order may be used)
    cached: bool  # queries are a suffix of a longer KV cache


def _layout(info: Optional[DilatedMaskInfo], position_ids, doc_ids, batch: int, sq: int, sk: int,
            device, ring: bool) -> _Layout:
    q_start = sk - sq if info is None else info.q_offset
    pad = None if info is None else info.padding_mask
    cached = sq != sk or isinstance(q_start, torch.Tensor) or q_start != 0
    memo = {} if info is None else info._memo
    key = ("cached" if cached else "self", sq, sk, id(position_ids), id(doc_ids), ring)
    hit = memo.get(key)
    if hit is not None and hit[0] is position_ids and hit[1] is doc_ids:
        return hit[2]

    if not cached:
        pos = position_ids
        if pos is not None:
            if pos.dim() == 1:
                pos = pos.unsqueeze(0)
            if pos.dim() != 2 or pos.shape[-1] != sq or pos.shape[0] not in (1, batch):
                raise ValueError(
                    f"hilbert_dilated needs position_ids of shape [B, S] = [{batch}, {sq}] (or [1, {sq}]), "
                    f"got {tuple(position_ids.shape)} (multi-axis rotary positions are not supported)"
                )
            pos = pos.to(device=device, dtype=torch.int64)
        docs = None
        if doc_ids is not None:
            docs = doc_ids.to(device=device, dtype=torch.int64)
            docs = docs.unsqueeze(0) if docs.dim() == 1 else docs
        elif pos is not None and ring:
            # A shard's positions jump where the layout skips (zigzag), so restarts cannot be
            # read locally, and local document numbers would differ between ranks.
            if bool((torch.diff(pos, dim=-1) <= 0).any()):
                raise ValueError(
                    "packed sequences under sequence_parallel need global document ids: pass "
                    "hilbert_doc_ids=[B, S_local] to the model's forward"
                )
        elif pos is not None:
            docs = _restart_doc_ids(pos)
        plain = docs is None and (
            pos is None or bool((pos == torch.arange(sq, device=device)).all())
        )
        if plain:
            pos = None
        q_doc = k_doc = docs
        if pad is not None:
            base = docs if docs is not None else torch.zeros(1, sq, dtype=torch.int64, device=device)
            k_doc = torch.where(pad, base, torch.full_like(base, -1))
            q_doc = base
        out = _Layout(pos, pos, q_doc, k_doc, plain, False)
    else:
        slots = torch.arange(sq, device=device, dtype=torch.int64) + q_start  # [Sq]
        if pad is not None:
            # Key j of sample b sits at (number of real tokens before it); pads never attended.
            k_pos = (pad.to(torch.int64).cumsum(-1) - 1).clamp_min(0)  # [B, Sk]
            q_pos = k_pos.gather(1, slots.unsqueeze(0).expand(k_pos.shape[0], sq))
            k_doc = torch.where(pad, 0, -1).to(torch.int64)
            q_doc = torch.zeros(1, sq, dtype=torch.int64, device=device)
            out = _Layout(q_pos, k_pos, q_doc, k_doc, False, True)
        else:
            out = _Layout(slots.unsqueeze(0), None, None, None, False, True)
    out = _Layout(*_same_batch(out.q_pos, out.k_pos, out.q_doc, out.k_doc), out.plain, out.cached)
    memo[key] = (position_ids, doc_ids, out)
    return out


def _same_batch(*ts):
    # Give every [Bp, S] tensor the same leading size (expanded views, no copies), so the op
    # sees one batch convention.
    batch = max((t.shape[0] for t in ts if t is not None), default=1)
    return [None if t is None else t.expand(batch, -1) for t in ts]


def hilbert_dilated_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """``AttentionInterface`` entry: dilated attention of one layer.

    Args:
        module: the attention module (``config``, ``is_causal``).
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Sk, D]`` (GQA from the shapes).
        attention_mask: the :class:`DilatedMaskInfo` of :func:`hilbert_dilated_mask`, or None.
        dropout: must be 0.
        scaling: softmax scale (default ``D ** -0.5``).
        is_causal: overrides ``module.is_causal``.
        **kwargs: ``position_ids`` ``[B, S]``; optional ``hilbert_doc_ids`` ``[B, S]`` (document
            ids, overriding the ones read from restarting positions).

    Returns:
        ``(out [B, Sq, Hq, D] contiguous, None)``.

    Raises:
        ValueError: for unsupported options (dropout, output_attentions, sliding windows,
            soft-capping, sinks, cross-attention, 4-D masks).
    """
    _check_call(module, dropout, kwargs)
    b, hq, sq, _ = query.shape
    sk = key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Cross-attention: GPT-2 flags it; Bart-style decoders use is_decoder with is_causal=False.
    cross = getattr(module, "is_cross_attention", False) or (
        not causal and getattr(module, "is_decoder", False))
    if cross or (not causal and sq != sk):
        raise ValueError(
            f"hilbert_dilated supports self-attention only, not cross-attention (queries {sq} vs "
            f"keys {sk} from another sequence); use sdpa for this model"
        )
    if attention_mask is not None and not isinstance(attention_mask, DilatedMaskInfo):
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(
            f"hilbert_dilated got a precomputed attention mask of shape {shape}; it needs the 2-D "
            "padding mask [B, S] that the model turns into its own compact description. Pass "
            "attention_mask as [B, S] (custom 4-D masks are not supported)"
        )
    if attention_mask is not None and attention_mask.kv_length != sk:
        raise ValueError(
            f"hilbert_dilated: the mask was built for {attention_mask.kv_length} keys but this layer "
            f"has {sk} (a sliding or otherwise different cache layer?)"
        )
    pattern = get_pattern(module.config)
    group = _ring.get_sequence_parallel_group()
    doc_ids = kwargs.get("hilbert_doc_ids")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if doc_ids is None and cu_seqlens is not None:
        # Flash-style varlen kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)):
        # one row of concatenated documents. Paged caches (continuous batching) also send them.
        if b != 1 or sq != sk:
            raise ValueError(
                "hilbert_dilated does not support paged / continuous-batching attention "
                f"(cu_seq_lens with batch {b}, {sq} queries, {sk} keys); use generate() instead"
            )
        starts = cu_seqlens.to(device=query.device, dtype=torch.int64)[1:-1]
        doc_ids = torch.bucketize(torch.arange(sq, device=query.device), starts, right=True)[None]
    lay = _layout(attention_mask, kwargs.get("position_ids"), doc_ids, b, sq, sk, query.device,
                  group is not None)

    if group is not None:
        if lay.cached:
            raise ValueError(
                "hilbert_dilated under sequence_parallel does not support a KV cache "
                "(generation); run generate() outside the sequence_parallel context"
            )
        positions = lay.q_pos
        if positions is None:  # a shard must know where it is; without position_ids it is 0..S-1
            positions = torch.arange(sq, device=query.device).unsqueeze(0)
        out = _ring.ring_attention(
            query, key, value, _natural(pattern), group=group, q_positions=positions,
            k_positions=positions, causal=causal, scale=scaling,
            q_doc_ids=lay.q_doc, k_doc_ids=lay.k_doc,
        )
        return out.transpose(1, 2).contiguous(), None

    ordering = pattern.ordering
    if ordering == "auto" and lay.plain:
        from ..hilbert import resolve_ordering

        ordering = resolve_ordering(pattern, sq, query.shape[-1], query.device)
    if ordering == "hilbert" and lay.plain and sq > 1:
        from ..hilbert import hilbert_permutation

        # Per-layer placement: store tokens in Hilbert order for the op, then restore.
        perm, inv = hilbert_permutation(sq, pattern, query.device)  # perm[i] = position at index i
        k_doc = None if lay.k_doc is None else lay.k_doc.index_select(-1, perm)
        q_doc = None if lay.q_doc is None else lay.q_doc.index_select(-1, perm)
        out = dilated_attention(
            query.index_select(2, perm), key.index_select(2, perm), value.index_select(2, perm),
            _natural(pattern), causal=causal, scale=scaling, q_positions=perm, k_positions=perm,
            q_doc_ids=q_doc, k_doc_ids=k_doc,
        )
        out = out.index_select(2, inv)
    else:
        attend = dilated_attention
        if lay.cached and torch.compiler.is_compiling():
            # generate() with a static cache compiles the forward with CUDA graphs; the op plans
            # explicit positions on the host (a device sync), which graph capture forbids.
            attend = _eager_dilated_attention
        out = attend(
            query, key, value, _natural(pattern), causal=causal, scale=scaling,
            q_positions=lay.q_pos, k_positions=lay.k_pos, q_doc_ids=lay.q_doc, k_doc_ids=lay.k_doc,
        )
    return out.transpose(1, 2).contiguous(), None


@torch.compiler.disable
def _eager_dilated_attention(*args, **kwargs):
    return dilated_attention(*args, **kwargs)


# ------------------------------------------------------------------------------ registration
def register() -> None:
    """Register ``"hilbert_dilated"`` with ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent (called by ``import hf_hilbert_attn``). Afterwards
    ``from_pretrained(..., attn_implementation="hilbert_dilated")`` and
    ``model.set_attn_implementation("hilbert_dilated")`` work.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, hilbert_dilated_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hilbert_dilated_mask)
