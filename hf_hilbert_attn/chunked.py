"""The PyTorch path: ``dilated_attention(..., backend="torch")``, and the op's path wherever the
Triton kernels do not run (CPU, float64, other head sizes, positions the kernels cannot plan).

Its engines (``engines/``) all compute exactly what ``reference.reference_attention``
computes; this picks one per call: the dense tiles of PyTorch's fused CPU kernel (causal
self-attention at positions 0..S-1, whole or per document), the masked fused call for a few
queries (decoding), else the blockwise engine (any device, positions and documents).
"""

from __future__ import annotations

from .engines.blockwise import _ChunkedAttention
from .engines.masked import _few_queries, _few_queries_apply, _few_queries_plan
from .engines.passes import CHUNK_K, CHUNK_Q, _cached_plan
from .engines.tiles import _document_runs, _FastAttention, _fast_documents, _fast_plan
from .numerics import accum_dtype

__all__ = ["chunked_attention", "CHUNK_Q", "CHUNK_K"]


def chunked_attention(q, k, v, pattern, a, *, causal=True):
    """Memory-efficient dilated attention in PyTorch (any device), differentiable.

    Computes exactly what :func:`reference_attention` computes, in float32 (float64 for float64
    inputs), without ever materialising ``[Sq, Sk]``: blocks of at most ``CHUNK_Q x CHUNK_K``
    scores (per batch row and head) planned in position space, with FlashAttention-style
    recomputation in the backward. Sliding windows visit only the keys within each query
    tile's windows, and sink tokens are one pass of every query against the first
    ``sink_tokens`` positions.

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` / ``[B, Hkv, Sk, Dv]``, read in place for GQA.
        pattern: the :class:`DilatedPattern`.
        a: the ``AttnInputs`` from ``check_inputs`` (scale, positions, document ids).
        causal: mask keys at later positions.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Sq, Dv]`` in ``q.dtype``; ``lse`` ``[B, Hq, Sq]`` in
        float32, float64 for float64 inputs (natural log; ``-inf`` and ``out = 0`` for a query with no allowed key).
    """
    b, hq, sq, _ = q.shape
    if b == 0 or sq == 0 or k.shape[2] == 0:  # nothing to attend: empty / all -inf rows
        out = q.new_zeros(b, hq, sq, v.shape[-1]) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, q.new_full((b, hq, sq), float("-inf"), dtype=accum_dtype(q.dtype))
    plan = _fast_plan(pattern, a, causal, q)
    if plan is not None:
        return _FastAttention.apply(q, k, v, plan, a.scale)
    if _few_queries_apply(pattern, a, q):
        return _few_queries(q, k, v, _few_queries_plan(pattern, a, causal, q.dtype), a.scale)
    runs = _document_runs(pattern, a, causal, q)
    if runs:
        return _fast_documents(q, k, v, pattern, a, runs)
    passes = _cached_plan(pattern, a, causal)
    out, lse = _ChunkedAttention.apply(q, k, v, pattern, passes, a.scale)
    return out, lse
