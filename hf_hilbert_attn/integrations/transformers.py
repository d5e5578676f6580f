"""``attn_implementation="hilbert_dilated"``: the attention and mask functions for Transformers
(guide: ``docs/transformers.md``).

Transformers calls the *mask* function once per forward and the *attention* function once per
layer. :func:`hilbert_dilated_mask` never builds a ``[B, 1, Sq, Sk]`` mask: it returns a
:class:`DilatedMaskInfo` (padding, cache offsets), which :func:`hilbert_dilated_attention_forward`
turns with ``position_ids`` into true positions (``inputs.model_positions``) for
:func:`hf_hilbert_attn.dilated_attention`, or the ring inside ``sequence_parallel``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import transformers
from packaging import version
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .. import ring as _ring
from ..compiler import disable_lazily
from ..decode import PreparedDecode, decodes, plan_decode, run_decode
from ..inputs import kernel_widths, model_positions
from ..numerics import autocast_inputs, with_sink_logits
from ..ops import dilated_attention, prepared
from ..patterns import DEFAULT_PATTERN, PatternLike, as_pattern
from ..ring.ulysses import _local_pattern
from .accelerate import deepspeed_head_slice
from .cache import attend_with_dropped_keys
from .model_config import ATTN_IMPLEMENTATION, LAYER_DENSE, get_pattern, layer_window, layers_differ
from .transformers_checks import check_call, check_layer_window, mask_window

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PATTERN", "DilatedMaskInfo", "configure", "get_pattern",
           "hilbert_dilated_attention_forward", "hilbert_dilated_mask", "register",
           "set_dense_kv_heads"]

if version.parse(transformers.__version__) < version.parse("5.0"):  # checked once, at import
    raise ImportError(f"hf_hilbert_attn needs transformers>=5.0, found {transformers.__version__}")


def _model_configs(model) -> list:
    # The model's config and every sub-model's (composite models), each once.
    if not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    found = [m.config for m in model.modules()
             if isinstance(getattr(m, "config", None), transformers.PretrainedConfig)]
    return list({id(c): c for c in [model.config, *found]}.values())


def set_dense_kv_heads(model, per_layer) -> "torch.nn.Module":
    """Give each decoder layer of ``model`` its own dense key/value heads (a calibration's choice,
    ``hf-hilbert-attn calibrate``), stored in ``config.hilbert_attn``. ``per_layer``: one list
    of key/value head indices per layer (``[]``: none), a dict ``{layer: [heads]}`` (other layers
    none), or None to remove the per-layer choice. The pattern is the model's
    (:func:`get_pattern`). Returns ``model``; ``ValueError`` names a bad layer or head.
    """
    configs = _model_configs(model)
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None) \
        or getattr(cfg, "n_head", None)
    base = get_pattern(cfg) if getattr(cfg, "hilbert_attn", None) is not None else as_pattern(None)
    d = base.to_dict()
    if per_layer is not None:
        if isinstance(per_layer, dict):
            if bad := [i for i in per_layer if not (isinstance(i, int) and 0 <= i < layers)]:
                raise ValueError(f"layers {bad} do not exist: the model has {layers} "
                                 f"(0..{layers - 1})")
            per_layer = [per_layer.get(i, ()) for i in range(layers)]
        if isinstance(per_layer, (str, bytes)) or not hasattr(per_layer, "__len__"):
            raise ValueError(f"per_layer must be one list of key/value head indices per layer, "
                             f"a dict {{layer: heads}} or None, got {per_layer!r}")
        if len(per_layer) != layers:
            raise ValueError(f"per_layer must list the dense key/value heads of all {layers} "
                             f"layers, got {len(per_layer)} entries")
        rows = d[LAYER_DENSE] = []
        for i, hs in enumerate(per_layer):
            try:  # the pattern checks each index (an integer >= 0, once) and sorts them
                if isinstance(hs, (str, bytes)) or not hasattr(hs, "__iter__"):
                    raise ValueError(f"dense key/value heads must be a list of head indices "
                                     f"([] for none), got {hs!r}")
                layer = base.replace(dense_kv_heads=tuple(hs))
                layer.check_kv_heads(heads)
                if layer.dense_kv_heads and layer_window(cfg, i) is not None:
                    raise ValueError("a sliding-window or chunked layer keeps its window "
                                     "(dense heads are for full-attention layers)")
            except ValueError as e:
                raise ValueError(f"layer {i}: {e}") from None
            rows.append(list(layer.dense_kv_heads))
    for c in configs:
        c.hilbert_attn = dict(d)
    return model


def configure(model, pattern: PatternLike = None, *, set_attn_implementation: bool = True,
              keep_dense_heads: bool = True):
    """Give ``model`` a dilated attention pattern, stored where ``save_pretrained`` keeps it.

    Writes ``pattern.to_dict()`` to ``config.hilbert_attn`` of the model and every sub-model, so
    ``config.json`` carries it. ``pattern``: a :class:`DilatedPattern`, its dict, a YAML path, a
    shipped name (``hf_hilbert_attn.patterns.names()``) or None (the default).
    ``set_attn_implementation``: also switch the model to ``"hilbert_dilated"`` (and hook a
    decoder-only base model to decide positions once per forward: ``_positions_hook``).
    ``keep_dense_heads``: a calibration's per-layer dense heads (:func:`set_dense_kv_heads`)
    stay with the new pattern, as they describe the model (docs/decisions.md, "Shipped
    retrieval defaults"); False drops them. Returns ``model`` (changed in place). Raises
    ``ValueError`` for an invalid pattern or, switching, a model whose layers never call
    Transformers' attention interface (Bloom, MPT); ``TypeError`` without a ``config``;
    sliding-window and chunked layers keep their window or chunks (:func:`get_pattern`).
    """
    pattern = as_pattern(pattern)
    configs = _model_configs(model)
    old = getattr(model.config, "hilbert_attn", None)
    layers = old.get(LAYER_DENSE) if keep_dense_heads and isinstance(old, dict) else None
    for cfg in configs:
        cfg.hilbert_attn = pattern.to_dict()
        if layers is not None:
            cfg.hilbert_attn[LAYER_DENSE] = [list(h) for h in layers]
    if set_attn_implementation:
        _check_interface(type(model).__name__,
                         frozenset(type(m).__module__ for m in model.modules()))
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
        if (vars(base).get("_hilbert_positions") is None and not model.config.is_encoder_decoder
                and "kwargs" in inspect.signature(base.forward).parameters):
            base._hilbert_positions = base.register_forward_pre_hook(_positions_hook,
                                                                     with_kwargs=True)
    return model


@functools.lru_cache(maxsize=64)  # (the mask function asks every forward; a refusal raises,
def _check_interface(name: str, modules: frozenset) -> None:  # so it is asked again)
    """``ValueError`` for a model (``name``: its class) whose layers never call Transformers'
    attention interface: none of its loaded modules of Transformers' models (``modules``: their
    names) has ``ALL_ATTENTION_FUNCTIONS``, so hilbert_dilated cannot reach them (Bloom, MPT)."""
    hf = [n for n in modules if n.startswith("transformers.models.") and n in sys.modules]
    if hf and not any("ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[n]) for n in hf):
        raise ValueError(f"{name} computes attention in classes of its own, not through "
                         "Transformers' attention interface: hilbert_dilated cannot reach its "
                         "layers; use sdpa or eager for this model")


class MaskReadError(AttributeError, ValueError):
    """A model reads the attention mask as a tensor outside the attention function."""

    def __init__(self, what: str):
        super().__init__(f"hilbert_dilated: this model reads the attention mask as a tensor "
                         f"(mask{what}) outside attention (e.g. a sparse-attention indexer); "
                         "hilbert_dilated hands layers a compact mask: use sdpa for this model")


@dataclass(eq=False)
class DilatedMaskInfo:
    """The compact "mask" every layer of a forward receives instead of ``[B, 1, Sq, Sk]``: the
    first query's cache slot (int; static caches: a 0-d tensor), the query / key lengths, the
    ``[B, kv_length]`` padding mask (True = real; None: no padding), the keys a
    ``PatternCache`` dropped and what a ``sliding_attention`` or ``chunked_attention`` layer's
    mask keeps (``model_config.local_pattern``)."""

    q_offset: Any
    q_length: int
    kv_length: int
    padding_mask: Optional[torch.Tensor] = None
    kv_offset: int = 0
    window: Optional[int] = None
    _memo: dict = field(default_factory=dict, repr=False)  # positions, shared by the layers

    @property
    def ndim(self) -> int:
        # generate() passes static-cache masks back in; masking_utils reads .ndim: a prepared 4-D
        return 4

    def __getattr__(self, name):  # what a tensor has and this description has not
        raise AttributeError(name) if name.startswith("_") else MaskReadError(f".{name}")

    def __getitem__(self, index):
        raise MaskReadError("[...]")


def hilbert_dilated_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0,
                         kv_offset: int = 0, mask_function=None,
                         attention_mask: Optional[torch.Tensor] = None, **kwargs) -> DilatedMaskInfo:
    """``AttentionMaskInterface`` entry: the mask described in O(B·Sk), never built. Arguments
    as ``transformers.masking_utils.sdpa_mask`` (``attention_mask``: the 2-D padding mask or
    None); ``ValueError`` for mask functions other than causal / sliding window / bidirectional
    / packed / padding.
    """
    if isinstance(attention_mask, DilatedMaskInfo):
        return attention_mask  # prepared by generate() for this very step
    config = kwargs.get("config")  # a model switched without configure: refused at its first
    if config is not None and not torch.compiler.is_compiling():  # forward, as configure does
        _check_interface(type(config).__name__.removesuffix("Config") + "Model", frozenset(
            [type(config).__module__.replace(".configuration_", ".modeling_")]))  # (its base)
    window = mask_window(mask_function)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"hilbert_dilated expects a 2-D padding mask [B, S], got shape "
                         f"{tuple(attention_mask.shape)}")
    slots = kv_length  # the slots the padding mask covers: the keys', or every slot (chunks)
    if kv_offset and window is not None:  # a sliding or chunked layer's cache holds the keys
        if window.sliding:  # from kv_offset on, in order; a window reads position differences
            attention_mask = None if attention_mask is None else attention_mask[:, kv_offset:]
            q_offset = q_offset - kv_offset  # only, so count slots from there
        else:  # chunks read positions: the mask of every slot, whose last are the keys
            slots = kv_offset + kv_length
            attention_mask = torch.ones(batch_size, slots, dtype=torch.bool, device=kwargs.get(
                "device", "cpu")) if attention_mask is None else attention_mask
        kv_offset = 0
    padding, missing = None if attention_mask is None else attention_mask.to(torch.bool), 0
    if padding is not None and not kv_offset:
        # The 2-D mask covers the tokens seen so far; a static cache has more (empty) slots:
        # they are padding.
        missing = max(0, slots - padding.shape[-1])
        padding = torch.nn.functional.pad(padding, (0, missing), value=False)[:, :slots]
    # one host sync per forward, as flash_attention_mask does; none for a static cache (its
    # empty slots are padding), so that CUDA graphs can capture its steps. A PatternCache that
    # dropped keys (kv_offset) keeps a padded 2-D mask as it is: its layers refuse it.
    if padding is not None and not missing and slots == kv_length and bool(padding.all()):
        padding = None
    if isinstance(q_offset, torch.Tensor):
        # A static cache's step counter, advanced in place by the first layer: keep this step's.
        q_offset = q_offset.clone()
    return DilatedMaskInfo(q_offset, q_length, kv_length, padding, kv_offset, window)


def _positions_hook(module, args, kwargs):
    """A configured decoder-only model's call without a given cache decides positions once, for
    every layer whose keys are its tokens (``hilbert_positions``): no graph break per layer."""
    x = kwargs.get("input_ids", args[0] if len(args) == 1 else None)
    x = kwargs.get("inputs_embeds") if x is None else x
    mask = kwargs.get("attention_mask")
    if (x is None or len(args) > 1 or kwargs.get("past_key_values") is not None
            or kwargs.get("cache") is not None  # (the cache's name from transformers 5.2x)
            or kwargs.get("cu_seq_lens_q") is not None or _ring.get_sequence_parallel_group()
            or not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() == 2)):
        return None
    if mask is not None and bool(mask.all()):  # all real: the mask function need not check again
        mask = kwargs["attention_mask"] = None
    padding = None if mask is None else mask.to(torch.bool)
    kwargs["hilbert_positions"] = model_positions(kwargs.get("position_ids"), kwargs.get(
        "hilbert_doc_ids"), padding, 0, x.shape[0], x.shape[1], x.shape[1], x.device)
    return args, kwargs


@torch.compiler.disable
def _positions(info: Optional[DilatedMaskInfo], position_ids, doc_ids, b, sq, sk, device, ring):
    # Without the hook: the first layer's result serves the others; opaque to torch.compile.
    memo, key = ({} if info is None else info._memo), (sq, sk, id(position_ids), id(doc_ids), ring)
    if (hit := memo.get(key)) is not None and hit[0] is position_ids and hit[1] is doc_ids:
        return hit[2]
    out = model_positions(position_ids, doc_ids, None if info is None else info.padding_mask,
                          sk - sq if info is None else info.q_offset, b, sq, sk, device,
                          sharded=ring)
    memo[key] = (position_ids, doc_ids, out)
    return out


def hilbert_dilated_attention_forward(module: torch.nn.Module, query: torch.Tensor,
                                      key: torch.Tensor, value: torch.Tensor, attention_mask,
                                      dropout: float = 0.0, scaling: Optional[float] = None,
                                      is_causal: Optional[bool] = None, **kwargs):
    """``AttentionInterface`` entry: dilated attention of one layer. query ``[B, Hq, Sq, D]``,
    key/value ``[B, Hkv, Sk, D]``; ``attention_mask``: the :class:`DilatedMaskInfo` or None;
    ``dropout`` must be 0; ``is_causal`` overrides ``module.is_causal``; ``kwargs``:
    ``position_ids`` ``[B, S]``, optionally ``hilbert_doc_ids`` ``[B, S]``, flash-style
    ``cu_seq_lens_q`` or ``hilbert_positions``, learned sink logits ``s_aux`` ``[Hq]`` (gpt-oss:
    ``numerics.with_sink_logits``), ``softcap`` (Gemma 2's soft-capped scores). Returns ``(out
    [B, Sq, Hq, D] contiguous, None)``; ``ValueError`` for what the op cannot do
    (``transformers_checks``)."""
    (b, _, sq, _), sk = query.shape, key.shape[2]
    # under torch.autocast (Trainer's bf16 / fp16, Accelerate's mixed precision): cast as SDPA
    # does, once, so that a layer's call is the one its prepared call was made for
    query, key, value = autocast_inputs(query, key, value)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    step = attention_mask  # the forward's mask: its memo holds the plans every layer shares
    attention_mask = _layer_sizes(attention_mask, module.config, sq, sk)
    pattern, run = _checked_pattern(module, dropout, causal, b, sq, sk, step, attention_mask,
                                    kwargs)
    if run and run[0].fits(query, key, value, scaling, kwargs.get("softcap")):  # prepared by
        # an earlier layer of this forward (its op's or decode step's call)
        return _layer_output(run[0](query, key, value), None, query.shape[-1])
    query, key, value, scaling, dv = kernel_widths(query, key, value, scaling)
    group, sinks = _ring.get_sequence_parallel_group(), kwargs.get("s_aux")  # learned sink
    sinks = None if sinks is None else sinks.view(1, -1, 1)  # logits, one per head (gpt-oss)
    softcap = kwargs.get("softcap")
    if group is None and sk > sq and causal:  # a decode step: one plan per forward, one run
        out = _decode_step(query, key, value, step, attention_mask, pattern, scaling, kwargs,
                           sinks is not None, run)
        if out is not None:
            return _layer_output(out, sinks, dv)
    if group is None and getattr(attention_mask, "kv_offset", 0):  # a PatternCache dropped keys
        return _layer_output(attend_with_dropped_keys(
            query, key, value, pattern, q_start=int(attention_mask.q_offset), causal=causal,
            dropped=int(attention_mask.kv_offset), scale=scaling, return_lse=sinks is not None,
            softcap=softcap), sinks, dv)
    # DeepSpeed's Ulysses: this rank's heads over the whole sequence, the gathered position_ids
    ds = None if group is not None else deepspeed_head_slice(module, query.shape[1])
    if ds is not None:
        pattern = _local_pattern(pattern, ds[1], ds[2])
        sinks = None if sinks is None else sinks[:, ds[0]:ds[0] + query.shape[1]]
    at = kwargs.get("hilbert_positions") if group is None and sq == sk and ds is None else None
    if at is None:
        doc_ids, cu_seqlens = kwargs.get("hilbert_doc_ids"), kwargs.get("cu_seq_lens_q")
        if doc_ids is None and cu_seqlens is not None:
            # Flash-style varlen kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=
            # True)): one row of concatenated documents (paged caches are refused above).
            starts = cu_seqlens.to(device=query.device, dtype=torch.int64)[1:-1]
            doc_ids = torch.bucketize(torch.arange(sq, device=query.device), starts,
                                      right=True)[None]
        at = _positions(attention_mask, kwargs.get("position_ids"), doc_ids, b, sq, sk,
                        query.device, group is not None)
    if group is not None:
        if at.cached:
            raise ValueError("hilbert_dilated under sequence_parallel does not support a KV cache "
                             "(generation); run generate() outside the sequence_parallel context")
        positions = at.q_positions  # a shard must know where it is: 0..S-1 without position_ids
        positions = torch.arange(sq, device=query.device)[None] if positions is None else positions
        return _layer_output(_ring.sequence_parallel_attention(
            query, key, value, pattern, group=group, mode=_ring.get_sequence_parallel_mode(),
            q_positions=positions, k_positions=positions,
            causal=causal, scale=scaling, q_doc_ids=at.q_doc_ids, k_doc_ids=at.k_doc_ids,
            return_lse=sinks is not None, softcap=softcap), sinks, dv)
    # generate() with a static cache compiles the forward with CUDA graphs; the op plans explicit
    # positions on the host (a device sync), which graph capture forbids: run it eagerly.
    eager = at.cached and torch.compiler.is_compiling()
    if not (torch.compiler.is_compiling() or run or at.q_positions is not None or ds
            or at.q_doc_ids is not None or sinks is not None or dv != query.shape[-1]):
        # the layers of this forward that call alike run the op's prepared call, once one ran
        # (ops.prepared: checked and routed once)
        run += [p for p in [prepared(query, key, value, pattern, causal=causal, scale=scaling,
                                     softcap=softcap)] if p is not None]
    return _layer_output((_eager_dilated_attention if eager else dilated_attention)(
        query, key, value, pattern, causal=causal, scale=scaling, q_positions=at.q_positions,
        k_positions=at.k_positions, q_doc_ids=at.q_doc_ids, k_doc_ids=at.k_doc_ids,
        return_lse=sinks is not None, softcap=softcap,
        **({} if ds is None else {"_head_base": ds[0]})), sinks, dv)


def _layer_output(result, sinks, dv):
    """``(out [B, Sq, Hq, Dv] contiguous, None)`` from the op's (or the decode run's) ``out`` or,
    with learned sinks, its ``(out, lse)``; the first ``dv`` features (``kernel_widths``). A
    decode run's ``out`` is already laid out so: no copy."""
    out = result if sinks is None else with_sink_logits(*result, sinks)
    out = out if out.shape[-1] == dv else out[..., :dv]
    return out.transpose(1, 2).contiguous(), None


def _checked_pattern(module, dropout, causal, b, sq, sk, step, info, kwargs):
    """``check_call``, then ``(the layer's pattern, a list for the prepared call it runs)``;
    once per forward for the layers that call alike (module class, config, arguments, the
    kwargs given; each layer where layers differ: dense heads, sliding windows or chunks by
    layer, whose list layers of one pattern share), kept in the forward's mask memo
    (``step``)."""
    traced = torch.compiler.is_compiling()
    memo = step._memo if isinstance(step, DilatedMaskInfo) and not traced else {}
    config = module.config
    if (layered := memo.get(("layered", id(config)))) is None:  # layer_idx read (compiled:
        # guarded, a recompile per layer) only where layers differ
        layered = memo[("layered", id(config))] = layers_differ(config)
    key = (type(module), id(config), getattr(module, "layer_idx", None) if layered else None,
           dropout, causal, b, sq, sk, getattr(info, "kv_length", info), vars(module).get(
               "is_cross_attention"), kwargs.get("sliding_window"), tuple(
               k for k, v in kwargs.items() if v is not None and v is not False))
    if (hit := memo.get(key)) is None:
        check_call(module, dropout, causal, b, sq, sk, info, DilatedMaskInfo, kwargs)
        check_layer_window(module, layer_window(config, key[2]), info, kwargs)
        pattern = get_pattern(config, key[2])  # (layers of one pattern share the list)
        hit = memo[key] = (pattern, memo.setdefault((*key[:2], pattern, *key[3:]), []))
    return hit


def _decode_step(query, key, value, step, info, pattern, scaling, kwargs, lse: bool, run: list):
    """A decode call (``decode.decodes``; else None): the step's plan, made by its first layer
    with this pattern and key count and kept in the forward's mask (``step``), then one run,
    whose ``out`` (a ``[B, Hq, Sq, D]`` view of ``[B, Sq, Hq, D]`` storage) and, with ``lse``
    (learned sinks), its lse it returns; without, the run's prepared call goes in ``run``
    (``_checked_pattern``'s list: the step's later layers that call alike run it). Under ``torch.compile`` (``generate()`` compiles a
    static cache's steps, with CUDA graphs under "reduce-overhead") the positions (cache slots
    and padding), plan and run are traced into the graph instead: no host sync, no graph break,
    the plan made per layer (device work inside the graph); a PatternCache's dropped keys,
    document ids or learned sinks (the run's lse) keep the eager step there, one opaque call."""
    position_ids, doc_ids = kwargs.get("position_ids"), kwargs.get("hilbert_doc_ids")
    dropped, traced = getattr(info, "kv_offset", 0), torch.compiler.is_compiling()
    if traced and (dropped or doc_ids is not None or lse
                   or not isinstance(info, DilatedMaskInfo)):
        return _eager_decode_step(query, key, value, step, info, pattern, scaling, kwargs, lse)
    (b, hq, sq, d), (hkv, sk), dev = query.shape, key.shape[1:3], query.device
    memo = step._memo if isinstance(step, DilatedMaskInfo) and not traced else {}
    key_ = ("decode", pattern, hq, hkv, sk, dropped, query.dtype)  # one entry each
    hit = memo.get(key_)
    if hit is None or hit[0] is not position_ids or hit[1] is not doc_ids:  # (by identity)
        if not decodes(query, key, value, pattern, kwargs.get("softcap")):
            return None
        if dropped:  # a PatternCache: slots [sinks | tail], the tail from sinks + dropped on
            qp, kp, qd, kd = int(info.q_offset), None, None, None
        else:
            at = model_positions(None, None, info.padding_mask, info.q_offset, b, sq, sk, dev) \
                if traced else _positions(info, position_ids, doc_ids, b, sq, sk, dev, False)
            qp, kp, qd, kd = at.q_positions, at.k_positions, at.q_doc_ids, at.k_doc_ids
        if kp is None:  # keys at their slots, queries the last ones or from q_offset on: the
            # cache's own layout (no tensors; eager, one launch kept across the steps)
            start = getattr(info, "q_offset", None)
            qp = sk - sq if qp is None else start if isinstance(start, int) else qp
            if traced or not isinstance(qp, int):  # (traced: tensors inside the graph)
                qp = torch.arange(sq, device=dev) + qp if isinstance(qp, int) else qp
                kp = torch.arange(sk, device=dev)
        hit = memo[key_] = (position_ids, doc_ids, plan_decode(
            pattern, hq, hkv, sk, qp, kp, q_doc_ids=qd, k_doc_ids=kd, dropped=dropped))
    elif torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                      or value.requires_grad):
        return None  # (what decodes() checks that a step's layers may not share)
    scale, softcap = d ** -0.5 if scaling is None else scaling, kwargs.get("softcap")
    out = run_decode(query, key, value, hit[2], scale, return_lse=lse, softcap=softcap)
    if not (lse or run or traced or isinstance(hit[2]._made, (torch.Tensor, type(None)))):
        run.append(PreparedDecode(query, key, value, hit[2], scale, softcap))  # (eager, on
    return out  # the decode kernel: the plan has its launcher)


# the eager step under torch.compile: one opaque call (its plan is host work kept in the mask)
_eager_decode_step = disable_lazily(_decode_step)


def _layer_sizes(info, config, sq: int, sk: int):
    """This layer's mask where a :class:`PatternCache`'s layers hold different key counts (dense
    heads keep all; Transformers gives the first layer's): it dropped ``q_offset + Sq - Sk``."""
    if (isinstance(info, DilatedMaskInfo) and info.kv_length != sk and info.padding_mask is None
            and isinstance(info.q_offset, int) and info.q_offset + sq >= sk
            and LAYER_DENSE in (getattr(config, "hilbert_attn", None) or {})):
        return DilatedMaskInfo(info.q_offset, info.q_length, sk, None, info.q_offset + sq - sk,
                               info.window)
    return info


_eager_dilated_attention = disable_lazily(dilated_attention)  # (one opaque call when compiled)


def register() -> None:
    """Register ``"hilbert_dilated"`` with ``AttentionInterface`` and ``AttentionMaskInterface``:
    ``from_pretrained`` and ``set_attn_implementation`` then take it. Idempotent (``import
    hf_hilbert_attn`` calls it); no other implementation's function is touched (decisions D36)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hilbert_dilated_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hilbert_dilated_mask)

