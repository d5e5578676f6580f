"""The public op ``dilated_attention`` and its dispatch between the PyTorch and Triton paths."""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import check_inputs
from .pattern import DilatedPattern

BACKENDS = ("auto", "torch", "triton")


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: DilatedPattern,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    q_positions: Optional[torch.Tensor] = None,
    k_positions: Optional[torch.Tensor] = None,
    q_doc_ids: Optional[torch.Tensor] = None,
    k_doc_ids: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """LongNet-style dilated attention (DESIGN §1), differentiable.

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``; query head ``h`` reads key/value head
            ``h // (Hq // Hkv)`` (never expanded in memory on the fast paths).
        pattern: the :class:`DilatedPattern`.
        causal: keys at positions ``> p`` are masked for a query at ``p``.
        scale: softmax scale, default ``D ** -0.5``.
        q_positions, k_positions: true positions ``[S]`` or ``[B, S]`` of the stored tokens
            (any storage order, e.g. Hilbert order or a ring shard). Default: keys at
            ``0..Sk-1``, queries at the last ``Sq`` positions (bottom-right aligned)::

                keys     0 1 2 3 4 5 6 7
                queries            5 6 7      (Sq = 3, Sk = 8, causal)

        q_doc_ids, k_doc_ids: document ids ``[S]`` or ``[B, S]`` for packed sequences; a pair is
            allowed only within a document; a negative key id marks padding.
        return_lse: also return the log-sum-exp ``[B, Hq, Sq]`` in float32 (natural log; ``-inf``
            for a query with no allowed key, whose output is 0).
        backend: ``"auto"`` (Triton on CUDA when the shape is supported, else PyTorch),
            ``"torch"`` or ``"triton"``.

    Returns:
        ``out`` ``[B, Hq, Sq, D]`` in the input dtype, and ``lse`` if ``return_lse``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    a = check_inputs(q, k, v, pattern, scale=scale, q_positions=q_positions,
                     k_positions=k_positions, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids)
    if backend == "triton" or (backend == "auto" and _triton_ok(q, a)):
        from .kernels import triton_dilated_attention  # noqa: F401 (added by the kernel work)

        out, lse = triton_dilated_attention(q, k, v, pattern, a, causal=causal)
    else:
        from .reference import chunked_attention

        out, lse = chunked_attention(q, k, v, pattern, a, causal=causal)
    return (out, lse) if return_lse else out


def _triton_ok(q: torch.Tensor, a) -> bool:
    return False
