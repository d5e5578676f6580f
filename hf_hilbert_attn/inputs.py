"""Validation and normalisation of attention inputs, shared by every implementation.

Conventions (DESIGN §3): q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``; ``Hq % Hkv == 0``.
Positions and document ids are ``[S]`` or ``[B, S]`` integer tensors. Without positions, keys
sit at ``0..Sk-1`` and queries at the *last* ``Sq`` positions (``Sk-Sq..Sk-1``, bottom-right
aligned, as in decoding with a cache)::

    keys     0 1 2 3 4 5 6 7
    queries            5 6 7      (Sq = 3, Sk = 8)

Document ids: a pair is allowed only inside one document; a key with a negative id is padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .pattern import DilatedPattern

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _positions(name, t, batch, length, device, default):
    if t is None:
        return default
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[-1] != length or t.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} must have shape [{length}] or [1 or {batch}, {length}], got {tuple(t.shape)}"
        )
    return t.to(device=device, dtype=torch.int64)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: DilatedPattern,
    *,
    scale: Optional[float] = None,
    q_positions=None,
    k_positions=None,
    q_doc_ids=None,
    k_doc_ids=None,
) -> AttnInputs:
    """Validate shapes/dtypes and normalise positions; raises ``ValueError``/``TypeError``."""
    if not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, got {type(pattern).__name__}")
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
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if scale is None:
        scale = d ** -0.5
    natural = q_positions is None and k_positions is None
    dev = q.device
    kp = _positions("k_positions", k_positions, b, sk, dev, None)
    if kp is None:
        kp = torch.arange(sk, device=dev, dtype=torch.int64).unsqueeze(0)
    qp = _positions("q_positions", q_positions, b, sq, dev, None)
    if qp is None:
        if q_positions is None and k_positions is not None and sq == sk:
            qp = kp  # self-attention over the given positions
        elif sq > sk and k_positions is None:
            raise ValueError(f"without positions, Sq ({sq}) must be <= Sk ({sk})")
        elif k_positions is None:
            qp = torch.arange(sk - sq, sk, device=dev, dtype=torch.int64).unsqueeze(0)
        else:
            raise ValueError("q_positions is required when k_positions is given and Sq != Sk")
    if (q_doc_ids is None) != (k_doc_ids is None):
        if sq == sk and k_doc_ids is not None:
            q_doc_ids = k_doc_ids
        else:
            raise ValueError("q_doc_ids and k_doc_ids must be given together")
    qd = _positions("q_doc_ids", q_doc_ids, b, sq, dev, None)
    kd = _positions("k_doc_ids", k_doc_ids, b, sk, dev, None)
    return AttnInputs(b, hq, hkv, sq, sk, d, v.shape[-1], float(scale), qp, kp, qd, kd, natural)
