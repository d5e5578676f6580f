"""Validation and normalisation of attention inputs, shared by every implementation, in
``ops.dilated_attention``'s conventions (shapes, positions bottom-right aligned by default, a
negative key document id is padding)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .pattern import DilatedPattern
from .plan_cache import kept, memoised

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Head sizes the Triton kernels are built for (read by ``backends.use_triton``, ``decode.decodes``).
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
KERNEL_DTYPES = _FLOAT_DTYPES[:3]  # and the dtypes they take: all but float64


@dataclass
class AttnInputs:
    batch: int
    hq: int
    hkv: int
    sq: int
    sk: int
    head_dim: int
    head_dim_v: int
    scale: float
    q_positions: torch.Tensor  # [Bp, Sq] int64, Bp in {1, B}
    k_positions: torch.Tensor  # [Bp, Sk] int64
    q_doc_ids: Optional[torch.Tensor]  # [Bd, Sq] int64 or None
    k_doc_ids: Optional[torch.Tensor]  # [Bd, Sk] int64 or None
    natural_positions: bool  # positions were not given (queries/keys at arange)
    # key/value heads whose results the caller discards (dense_heads.py): their out/lse
    # unspecified, gradients arriving for them zero; long kernel calls skip them (D41)
    skip_kv_heads: tuple = ()
    # query head h follows the pattern's rule as head head_base + h (a head-sharded rank's
    # heads: ring/ulysses.py); the pattern's dense key/value heads are given in local indices
    head_base: int = 0
    # scores s (scaled) are taken as softcap * tanh(s / softcap) (Gemma 2); 0: they are not
    softcap: float = 0.0


def _positions(name, t, batch, length, device):
    if t is None:
        return None
    t = torch.as_tensor(t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    t = t.unsqueeze(0) if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[-1] != length or t.shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape [{length}] or ["
                         f"{1 if batch == 1 else f'1 or {batch}'}, {length}], got {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


_ARANGE: dict = {}  # (start, stop, device) -> [1, stop - start] int64


def _arange_row(start: int, stop: int, device) -> torch.Tensor:
    """Positions ``start..stop-1`` as ``[1, n]`` int64: the default positions. Cached per
    (start, stop, device) in eager mode (every layer of every step asks for the same ones; on a
    GPU each was a kernel launch); made afresh while ``torch.compile`` traces or a CUDA graph
    is captured. Shared between calls, so read-only: nothing here writes into positions."""
    device = torch.device(device)
    if torch.compiler.is_compiling() or (device.type == "cuda"
                                         and torch.cuda.is_current_stream_capturing()):
        return torch.arange(start, stop, device=device, dtype=torch.int64).unsqueeze(0)
    return memoised(_ARANGE, (start, stop, device), 64, lambda: kept(
        lambda: torch.arange(start, stop, device=device, dtype=torch.int64).unsqueeze(0), device))


def _layout_hint(q: torch.Tensor, k: torch.Tensor) -> str:
    """The end of a shape error when q and k read as ``[B, S, H, D]`` make sense (query heads a
    multiple of key/value heads, no more queries than keys): the likeliest cause is a
    Transformers-style ``[B, S, H, D]`` tensor. Empty otherwise."""
    hq, hkv, sq, sk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv or sq > sk or (hq, sq) == (q.shape[1], q.shape[2]):
        return ""
    return (f"; expected [B, H, S, D] (heads before sequence), got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}: did you pass [B, S, H, D]? use .transpose(1, 2)")


def kernel_widths(q, k, v, scale: Optional[float], kernels: Optional[bool] = None):
    """Head sizes the kernels lack, where they run (``kernels``; default: on a GPU), such as
    MLA's 192 for q/k and 128 for v or Phi's 80 or 96: ``(q, k, v, scale, Dv)``, q, k, v padded
    with zeros to the next size the kernels take (the scores and the first ``Dv`` output
    features unchanged), the scale of the true size; else as given."""
    d, dv = q.shape[-1], v.shape[-1]
    if (d == dv and d in KERNEL_HEAD_DIMS) or not (q.is_cuda if kernels is None else kernels) \
            or max(d, dv) > KERNEL_HEAD_DIMS[-1]:  # (every layer call: the usual case first)
        return q, k, v, scale, dv
    width = max(16, 1 << (max(d, dv) - 1).bit_length())
    q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    return q, k, v, d ** -0.5 if scale is None else scale, dv


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: DilatedPattern, *,
                 scale: Optional[float] = None, q_positions=None, k_positions=None,
                 q_doc_ids=None, k_doc_ids=None, softcap: Optional[float] = None) -> AttnInputs:
    """Validate shapes/dtypes and normalise positions; raises ``ValueError``/``TypeError``."""
    if not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, got {type(pattern).__name__} "
                        "(hf_hilbert_attn.patterns.as_pattern reads a name, a YAML path, a dict)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16/bfloat16/float32/float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in [B, H, S], got {tuple(k.shape)} and {tuple(v.shape)}")
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})"
                         + _layout_hint(q, k))
    if scale is not None and (isinstance(scale, (str, bytes)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    scale = d ** -0.5 if scale is None else scale
    if softcap is not None and not (type(softcap) in (int, float) and 0 < softcap < math.inf):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    dev = q.device
    try:
        kp = _positions("k_positions", k_positions, b, sk, dev)
        qp = _positions("q_positions", q_positions, b, sq, dev)
    except ValueError as e:  # positions of S tokens where dim 1 holds S: [B, S, H, D] tensors
        swapped = any(isinstance(p, torch.Tensor) and p.shape[-1:] == t.shape[1:2] != t.shape[2:3]
                      for p, t in ((k_positions, k), (q_positions, q)))
        raise ValueError(str(e) + (_layout_hint(q, k) if swapped else "")) from None
    kp = _arange_row(0, sk, dev) if kp is None else kp
    if qp is None and k_positions is not None:
        if sq != sk:
            raise ValueError("q_positions is required when k_positions is given and Sq != Sk")
        qp = kp  # self-attention over the given positions
    elif qp is None:
        if sq > sk:
            raise ValueError(f"without positions, Sq ({sq}) must be <= Sk ({sk})"
                             + _layout_hint(q, k))
        qp = _arange_row(sk - sq, sk, dev)
    if (q_doc_ids is None) != (k_doc_ids is None):
        if sq != sk or k_doc_ids is None:
            raise ValueError("q_doc_ids and k_doc_ids must be given together")
        q_doc_ids = k_doc_ids
    qd = _positions("q_doc_ids", q_doc_ids, b, sq, dev)
    kd = _positions("k_doc_ids", k_doc_ids, b, sk, dev)
    pattern.check_kv_heads(hkv)
    return AttnInputs(b, hq, hkv, sq, sk, d, v.shape[-1], float(scale), qp, kp, qd, kd,
                      q_positions is None and k_positions is None, softcap=float(softcap or 0.0))


def restart_documents(positions: torch.Tensor) -> Optional[torch.Tensor]:
    """Document ids ``[B, S]`` (0, 1, ...) of packed rows whose positions restart per document,
    or None when every row is one document.

    A position that does not follow its predecessor by 1 starts a new document: the rule of
    ``DataCollatorWithFlattening`` and of Transformers' ``find_packed_sequence_indices``.
    """
    new_doc = torch.diff(positions, dim=-1) != 1  # [B, S-1]
    return torch.nn.functional.pad(new_doc, (1, 0), value=False).cumsum(-1) \
        if bool(new_doc.any()) else None


@dataclass
class ModelPositions:
    """True positions and document ids of one self-attention call (None: the op's default)."""

    q_positions: Optional[torch.Tensor]  # [Bp, Sq] int64
    k_positions: Optional[torch.Tensor]  # [Bp, Sk] int64
    q_doc_ids: Optional[torch.Tensor]  # [Bd, Sq] int64
    k_doc_ids: Optional[torch.Tensor]  # [Bd, Sk] int64, -1 on padding
    cached: bool  # the queries are the last slots of a longer KV cache


def model_positions(position_ids, doc_ids, padding_mask, q_offset, batch: int, sq: int, sk: int,
                    device, *, sharded: bool = False) -> ModelPositions:
    """The positions a model's attention layer hands the op (the pattern follows true positions,
    never storage indices).

    * No cache (``q_offset == 0`` and ``sq == sk``): ``position_ids`` ``[B or 1, S]``;
      restarting positions are packed documents (:func:`restart_documents`) unless ``doc_ids``
      are given; ``0..S-1`` with one document becomes None (natural order, where
      ``pattern.ordering`` applies). A ``sharded`` (sequence-parallel) row needs ``doc_ids``.
    * With a cache: slot ``j`` of row ``b`` sits at ``cumsum(padding_mask[b])[j] - 1`` (at ``j``
      without a mask), as generate's ``position_ids``; the queries are the cache slots
      ``q_offset ..``, the keys the last ``sk``. (A ``PatternCache`` that dropped keys goes to
      ``integrations.cache.attend_with_dropped_keys`` instead.)

    ``padding_mask`` ``[B, Sk]`` (True = a real token) or None; padded keys get document id -1
    and are never attended. Every returned ``[B', S]`` tensor has the same leading size.
    """
    if sq != sk or isinstance(q_offset, torch.Tensor) or q_offset != 0:  # with a cache
        if padding_mask is None and not isinstance(q_offset, torch.Tensor) and \
                q_offset + sq == sk:  # the queries are the last keys: the op's default layout
            return ModelPositions(None, None, None, None, True)
        slots = torch.arange(sq, device=device, dtype=torch.int64) + q_offset  # [Sq]
        if padding_mask is None:
            return ModelPositions(slots.unsqueeze(0), None, None, None, True)
        k_pos = (padding_mask.to(torch.int64).cumsum(-1) - 1).clamp_min(0)  # [B, >= Sk]
        q_pos = k_pos.gather(1, slots.unsqueeze(0).expand(k_pos.shape[0], sq))
        k_doc = torch.where(padding_mask[:, -sk:], 0, -1).to(torch.int64)
        q_doc = torch.zeros(1, sq, dtype=torch.int64, device=device)
        return ModelPositions(*_same_batch(q_pos, k_pos[:, -sk:], q_doc, k_doc), True)

    pos = None
    if position_ids is not None:
        pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
        if pos.dim() != 2 or pos.shape[-1] != sq or pos.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids must have shape [B, S] = [{batch}, {sq}] (or [1, {sq}]), got "
                f"{tuple(position_ids.shape)} (multi-axis rotary positions are not supported)")
        pos = pos.to(device=device, dtype=torch.int64)
    if pos is not None and doc_ids is None and _is_arange(pos):
        pos = None  # the model's default position_ids (0..S-1, pads included)
    if padding_mask is not None and doc_ids is None and not sharded:
        pos = padded_positions(pos, padding_mask)
    docs = None
    if doc_ids is not None:
        docs = doc_ids.to(device=device, dtype=torch.int64)
        docs = docs.unsqueeze(0) if docs.dim() == 1 else docs
    elif pos is not None and sharded:
        # A shard's positions jump where the layout skips (zigzag), so restarts cannot be read
        # locally, and local document numbers would differ between ranks.
        if bool((torch.diff(pos, dim=-1) <= 0).any()):
            raise ValueError(
                "packed sequences under sequence_parallel need global document ids: pass "
                "hilbert_doc_ids=[B, S_local] to the model's forward")
    elif pos is not None:
        docs = restart_documents(pos)
    if docs is None and pos is not None and _is_arange(pos):
        pos = None  # natural order (e.g. right padding)
    q_doc = k_doc = docs
    if padding_mask is not None:
        q_doc = docs if docs is not None else torch.zeros(1, sq, dtype=torch.int64, device=device)
        k_doc = torch.where(padding_mask, q_doc, torch.full_like(q_doc, -1))
    return ModelPositions(*_same_batch(pos, pos, q_doc, k_doc), False)


def _is_arange(p: torch.Tensor, start: int = 0) -> bool:
    return bool((p == torch.arange(start, start + p.shape[-1], device=p.device)).all())


def padded_positions(pos: Optional[torch.Tensor], padding_mask: torch.Tensor) -> torch.Tensor:
    """True positions ``[B, S]`` of padded rows, so that a row computes what it computes alone.

    The pattern reads absolute positions, so pads must not count: a left-padded row's real
    tokens sit at ``0, 1, ...`` (``pos`` None) or keep the positions given; pads (never
    attended) take the positions after the row's last real one, so each row stays a
    permutation the kernels map (right padding stays ``0..S-1``).
    """
    real = padding_mask.to(torch.bool)
    pos = real.to(torch.int64).cumsum(-1) - 1 if pos is None else pos.expand(real.shape)
    after = torch.where(real, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True) + 1
    return torch.where(real, pos, after + (~real).to(torch.int64).cumsum(-1) - 1)


def _same_batch(*ts):
    # Every [B', S] tensor with the same leading size (expanded views, no copies).
    batch = max([t.shape[0] for t in ts if t is not None] or [1])  # (traceable: no default=)
    return [None if t is None else t.expand(batch, -1) for t in ts]
