"""Decoding: a few queries against a key/value cache, as one plan per forward and one run per
layer (the plan/run split of ``docs/kernels.md``, "Decoding").

Every layer of a decode step attends at the same positions, so the host work — which cached
key each query head may attend, from the pattern, the positions, documents, padding and dense
heads — is done once, by :func:`plan_decode`, into a :class:`DecodePlan` kept on the device.
:func:`run_decode` then only launches the decode kernel (``kernels._decode``: split over keys,
tiles no query attends never loaded; on a CPU, one fused SDPA call with the plan as its mask). Dense key/value heads are rows of the same plan (every
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
CPU_KEY_RATIO = 2.0  # on a CPU: cached keys per key the pattern reads, at most (D35)
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


def decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: DilatedPattern) -> bool:
    """Whether a call of ``q`` ``[B, Hq, Sq, D]`` against ``k``/``v`` ``[B, Hkv, Sk, D]`` is a
    decode call :func:`run_decode` takes: at most ``DECODE_MAX_QUERIES`` queries, no gradient
    to record, one supported dtype, equal head dims; on CUDA (or in Triton's interpreter where
    asked: ``HF_HILBERT_DECODE_KERNEL=1``, tests) the kernel's head dims and tile; on a CPU,
    which reads every key, while ``pattern`` reads at least ``1 / CPU_KEY_RATIO`` of them (else the op's
    blockwise path, which reads only those, is faster: docs/decisions.md D35, D50)."""
    sq, hq, hkv, sk = q.shape[2], q.shape[1], k.shape[1], k.shape[2]
    kernel = _kernel(q)
    reads = sum(min(w, sk) // r for w, r in pattern.configs) + pattern.sink_tokens
    return ((kernel or q.device.type == "cpu" and _SDPA_CPU is not None
             and sk <= CPU_KEY_RATIO * reads)
            and 0 < sq <= DECODE_MAX_QUERIES and k.shape[2] > 0 and q.dtype == k.dtype == v.dtype
            and q.dtype in _DTYPES and q.shape[-1] == v.shape[-1] and hkv > 0 and hq % hkv == 0
            and (not kernel or q.shape[-1] in KERNEL_HEAD_DIMS and (hq // hkv) * sq <= _MAX_ROWS)
            and not (torch.is_grad_enabled()
                     and (q.requires_grad or k.requires_grad or v.requires_grad)))


def _kernel(q: torch.Tensor) -> bool:
    """Whether the decode kernel runs (CUDA, or the interpreter where asked); else PyTorch."""
    return q.is_cuda or (os.environ.get("HF_HILBERT_DECODE_KERNEL") == "1"
                         and os.environ.get("TRITON_INTERPRET") == "1")


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
    ``out`` (and ``lse`` ``[B, Hq, Sq]`` float32). Under ``torch.compile`` (``out`` only) one
    custom op, which CUDA graphs capture."""
    if k.shape[2] != plan.sk:
        raise ValueError(f"decode plan made for {plan.sk} keys, called with {k.shape[2]}")
    if torch.compiler.is_compiling() and not return_lse:
        return torch.ops.hf_hilbert_attn.decode(q, k, v, plan.bias, plan.sk, float(scale))
    if not _kernel(q):
        out, lse = _torch_decode(q, k, v, plan, scale)
    else:
        from .kernels._decode import decode_fwd  # imports Triton: on the first decode call

        out, lse = decode_fwd(q, k, v, plan.bias, scale, interpret=not q.is_cuda)
    return (out, lse) if return_lse else out


def _torch_decode(q, k, v, plan: DecodePlan, scale: float):
    """:func:`run_decode` off CUDA: one fused SDPA call per layer with the plan's bias as its
    float mask, the query heads of a key/value head as rows (in float32; float64 stays)."""
    (b, hq, sq, d), hkv = q.shape, k.shape[1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bias = plan.bias[..., :plan.sk].to(cdt)
    out, lse = _SDPA_CPU(q.to(cdt).reshape(b, hkv, hq // hkv * sq, d), k.to(cdt), v.to(cdt),
                         0.0, False, attn_mask=bias, scale=scale)
    # (a row with no allowed key: SDPA gives out 0 and lse 0; the contract says -inf)
    lse = lse.float().masked_fill(torch.isneginf(bias).all(-1), float("-inf"))
    return out.to(q.dtype).reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


_SDPA_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@torch.library.custom_op("hf_hilbert_attn::decode", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, sk: int,
               scale: float) -> torch.Tensor:
    return run_decode(q, k, v, DecodePlan(bias, sk), scale)


@_decode_op.register_fake
def _(q, k, v, bias, sk, scale):
    return torch.empty_like(q)
