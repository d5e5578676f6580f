"""Decoding: a few queries against a key/value cache, as one plan per forward and one run per
layer (the plan/run split of ``docs/kernels.md``, "Decoding").

Every layer of a decode step attends at the same positions, so the host work — which cached
key each query head may attend, from the pattern, the positions, documents, padding and dense
heads — is done once, by :func:`plan_decode`, into a :class:`DecodePlan` kept on the device.
:func:`run_decode` then only launches the decode kernel (``kernels._decode``: split over keys,
tiles no query attends never loaded). Dense key/value heads are rows of the same plan (every
key allowed), so they cost no second call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from .inputs import KERNEL_HEAD_DIMS
from .pattern import DilatedPattern

__all__ = ["DECODE_MAX_QUERIES", "DecodePlan", "plan_decode", "run_decode", "decodes"]

DECODE_MAX_QUERIES = 16  # queries per call (decoding, speculative decoding); more: the op
_MAX_ROWS = 128  # (Hq // Hkv) * Sq rows of the kernel's tile
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(eq=False)
class DecodePlan:
    """The keys each query head may attend: ``bias`` ``[Bm, Hkv, (Hq // Hkv) * Sq, Skp]``
    float32, 0 where allowed and ``-inf`` elsewhere (``Bm`` 1 where every row is alike, ``Skp``
    ``Sk`` rounded up to 16 for aligned rows; row ``g * Sq + i`` is query ``i`` of query head
    ``j * (Hq // Hkv) + g``)."""

    bias: torch.Tensor
    sk: int


def decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call of ``q`` ``[B, Hq, Sq, D]`` against ``k``/``v`` ``[B, Hkv, Sk, D]`` is a
    decode call :func:`run_decode` takes: on CUDA (or in Triton's interpreter where asked:
    ``HF_HILBERT_DECODE_KERNEL=1``, tests), at most ``DECODE_MAX_QUERIES`` queries, no gradient
    to record, one supported dtype, equal head dims of a kernel size. (On a CPU the op's
    few-queries engine decodes: one masked call per step, ``engines/masked.py``.)"""
    sq, hq, hkv = q.shape[2], q.shape[1], k.shape[1]
    return ((q.is_cuda or os.environ.get("HF_HILBERT_DECODE_KERNEL") == "1"
             and os.environ.get("TRITON_INTERPRET") == "1")
            and 0 < sq <= DECODE_MAX_QUERIES and k.shape[2] > 0 and q.dtype == k.dtype == v.dtype
            and q.dtype in _DTYPES and q.shape[-1] == v.shape[-1] in KERNEL_HEAD_DIMS
            and hkv > 0 and hq % hkv == 0 and (hq // hkv) * sq <= _MAX_ROWS
            and not (torch.is_grad_enabled()
                     and (q.requires_grad or k.requires_grad or v.requires_grad)))


def plan_decode(pattern: DilatedPattern, num_heads: int, num_kv_heads: int, sk: int,
                q_positions: torch.Tensor, k_positions: torch.Tensor, *, causal: bool = True,
                q_doc_ids: Optional[torch.Tensor] = None,
                k_doc_ids: Optional[torch.Tensor] = None) -> DecodePlan:
    """The plan of a decode step: positions ``[Sq]`` / ``[B, Sq]`` of the queries and ``[Sk]``
    / ``[B, Sk]`` of the cached keys (true positions, slot order), document ids likewise (a
    negative key id: padding). The pattern's rule (``DilatedPattern.build_mask``), dense heads
    included; O(Hq · Sq · Sk) device work, no host sync."""
    allowed = pattern.build_mask(num_heads, q_positions, k_positions, causal=causal,
                                 q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                                 num_kv_heads=num_kv_heads)  # [Bm, Hq, Sq, Sk] bool
    bm, _, sq, _ = allowed.shape
    rows = num_heads // num_kv_heads * sq
    bias = torch.full((bm, num_kv_heads, rows, -(-sk // 16) * 16), float("-inf"),
                      dtype=torch.float32, device=allowed.device)
    bias[..., :sk].masked_fill_(allowed.reshape(bm, num_kv_heads, rows, sk), 0.0)
    return DecodePlan(bias, sk)


def run_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan,
               scale: float, return_lse: bool = False):
    """Attention of ``q`` ``[B, Hq, Sq, D]`` over ``k``/``v`` ``[B, Hkv, Sk, D]`` as ``plan``
    allows (a query with none: output 0, lse -inf): the decode kernel, two launches. Returns
    ``out`` (and ``lse`` ``[B, Hq, Sq]`` float32)."""
    if k.shape[2] != plan.sk:
        raise ValueError(f"decode plan made for {plan.sk} keys, called with {k.shape[2]}")
    if not _KERNEL:
        from .kernels._decode import decode_fwd  # imports Triton: on the first decode call

        _KERNEL.append(decode_fwd)
    out, lse = _KERNEL[0](q, k, v, plan.bias, scale, interpret=not q.is_cuda)
    return (out, lse) if return_lse else out


_KERNEL = []
