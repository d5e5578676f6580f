"""The PyTorch path: ``dilated_attention(..., backend="torch")``, and the op's path wherever the
Triton kernels do not run (CPU, float64, other head sizes, positions the kernels cannot plan).

Its engines (``engines/``) all compute exactly what ``reference.reference_attention``
computes; :data:`ENGINES` lists them in the order a call tries them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .engines import blockwise, tiles
from .engines.passes import CHUNK_K, CHUNK_Q
from .numerics import accum_dtype
from .planning import for_ranges

__all__ = ["chunked_attention", "CHUNK_Q", "CHUNK_K", "ENGINES"]

# The PyTorch engines, in order of preference: ``(plan, attend)``; ``plan(pattern, a, causal,
# q)`` is None where the engine does not take the call, ``attend(q, k, v, pattern, a, plan)``
# computes it (differentiable). The blockwise engine takes every call.
ENGINES = (
    (tiles.plan_whole, tiles.attend_whole),  # causal self-attention at 0..S-1 on CPU
    (tiles.plan_documents, tiles.attend_documents),  # whole packed documents on CPU
    (blockwise.plan, blockwise.attend),
)


def chunked_attention(q, k, v, pattern, a, *, causal=True):
    """Memory-efficient dilated attention in PyTorch (any device), differentiable.

    Computes exactly what :func:`reference_attention` computes, in float32 (float64 for float64
    inputs), without ever materialising ``[Sq, Sk]`` (the engines of :data:`ENGINES`).

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` / ``[B, Hkv, Sk, Dv]``, read in place for GQA.
        pattern, causal: as in ``dilated_attention``; ``a``: ``check_inputs``'s result.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Sq, Dv]`` in ``q.dtype``; ``lse`` ``[B, Hq, Sq]`` in
        float32 (float64 inputs: float64), natural log, ``-inf`` (``out = 0``) with no key.
    """
    b, hq, sq, _ = q.shape
    if b == 0 or sq == 0 or k.shape[2] == 0:  # nothing to attend: empty / all -inf rows
        out = q.new_zeros(b, hq, sq, v.shape[-1]) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, q.new_full((b, hq, sq), float("-inf"), dtype=accum_dtype(q.dtype))
    if a.head_base and pattern.query_dilation == "per_head":
        return _numbered_heads(q, k, v, pattern, a, causal)
    if a.natural_positions:  # keys at 0..Sk-1, queries the last Sq of them
        pattern = for_ranges(pattern, a.sk - sq, a.sk - 1, 0, a.sk - 1, causal)
    for plan, attend in ENGINES:
        if (made := plan(pattern, a, causal, q)) is not None:
            return attend(q, k, v, pattern, a, made)
    raise AssertionError("the blockwise engine takes every call")


def _numbered_heads(q, k, v, pattern, a, causal):
    """``chunked_attention`` of heads numbered from ``a.head_base`` (a head shard's): the engines
    number heads from 0, so ``p`` zero heads go in front, ``p`` congruent to ``head_base``
    modulo every rate and a whole number of key/value heads (their results are dropped)."""
    g = a.hq // a.hkv
    p = a.head_base % math.lcm(g, *pattern.dilation_rates)
    a = dataclasses.replace(a, hq=a.hq + p, hkv=a.hkv + p // g, head_base=0,
                            skip_kv_heads=tuple(j + p // g for j in a.skip_kv_heads))
    if pattern.dense_kv_heads:
        pattern = pattern.replace(dense_kv_heads=[j + p // g for j in pattern.dense_kv_heads])

    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, n, 0))  # n zero heads in front
               for t, n in ((q, p), (k, p // g), (v, p // g)))
    return tuple(t[:, p:] for t in chunked_attention(q, k, v, pattern, a, causal=causal))
