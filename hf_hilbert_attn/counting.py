"""Exact counts of the pairs a :class:`~hf_hilbert_attn.DilatedPattern` allows, and so its FLOPs,
without materialising ``S²`` (``DilatedPattern.count_pairs`` and friends call these).

Inclusion–exclusion over subsets of configs: a subset's intersection is "same segment (sliding:
inside every window) in every config, ``p ≡ s`` modulo the lcm of its rates", counted in closed
form per query, one lookup per head (queries grouped by class vector). Sinks: the sink keys plus
the configs' pairs on keys ``>= k`` only; a head of a dense key/value head counts every pair.
"""

from __future__ import annotations

import itertools
import math
import operator
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .pattern import DilatedPattern

__all__ = ["count_pairs"]


def count_pairs(pattern: "DilatedPattern", seq_len: int, num_heads: int, *, causal: bool = True,
                q_len: Optional[int] = None, num_kv_heads: Optional[int] = None) -> list:
    """Allowed (query, key) pairs per query head: keys at ``0..seq_len-1``, queries the last
    ``q_len`` positions (default: all); see :meth:`DilatedPattern.count_pairs`."""
    seq_len = int(seq_len)
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    q_len = seq_len if q_len is None else int(q_len)
    if not 0 <= q_len <= seq_len:
        raise ValueError(f"q_len must be in [0, seq_len={seq_len}], got {q_len}")
    dense = pattern.dense_query_heads(num_heads, num_kv_heads).tolist()
    sparse = _count_sparse(pattern.segment_lengths, pattern.dilation_rates,
                           pattern.query_dilation == "per_head", pattern.sink_tokens,
                           pattern.sliding, seq_len, num_heads, causal, q_len)
    first = seq_len - q_len  # dense: keys 0..p (causal) or all, for p in [first, seq_len)
    full = (first + 1 + seq_len) * q_len // 2 if causal else q_len * seq_len
    return [full if d else n for d, n in zip(dense, sparse)]


@lru_cache(maxsize=256)
def _count_sparse(w_all: tuple, r_all: tuple, per_head: bool, sink: int, sliding: bool,
                  seq_len: int, num_heads: int, causal: bool, q_len: int) -> tuple:
    """Per query head, the pairs the configs and the sinks allow (no dense heads)."""
    totals = [0] * num_heads
    chunk = 1 << 20
    for start in range(seq_len - q_len, seq_len, chunk):
        p = torch.arange(start, min(seq_len, start + chunk), dtype=torch.int64)
        if sink:  # the sink keys [0, min(k, ..)); the configs count keys >= k below
            n_sink = int((torch.clamp(p + 1, max=sink) if causal else
                          torch.full_like(p, min(sink, seq_len))).sum())
            totals = [t + n_sink for t in totals]
        for size in range(1, len(w_all) + 1):
            sign = 1 if size % 2 else -1
            for subset in itertools.combinations(range(len(w_all)), size):
                ws, rs = [w_all[j] for j in subset], [r_all[j] for j in subset]
                cnt = _keys_per_query(p, ws, math.lcm(*rs), sink, sliding, seq_len, causal)
                per = _per_head(p, cnt, ws, rs, sliding, num_heads) if per_head else \
                    [int(cnt.sum())] * num_heads
                totals = [t + sign * n for t, n in zip(totals, per)]
    return tuple(totals)


def _keys_per_query(p, ws, m, sink, sliding, seq_len, causal) -> torch.Tensor:
    """For each query ``p``, the keys ``s`` every config of the subset shares with it (same
    segment or inside every window, ``s ≡ p (mod m)``), above the sinks."""
    # keys s in [lo, hi] with s ≡ p (mod m); p itself lies in [lo, hi] (hi >= p) but for the
    # sinks: above them only, lo >= k from the start (then p may lie below lo: count from lo up)
    lo, hi = torch.full_like(p, sink), torch.full_like(p, seq_len - 1)
    for w in ws:
        s0 = p - (w - 1) if sliding else (p // w) * w  # p's window, or p's segment
        s1 = p + (w - 1) if sliding else s0 + w - 1
        lo, hi = torch.maximum(lo, s0), torch.minimum(hi, s1)
    hi = torch.minimum(hi, p) if causal else hi
    first = p - torch.div(p - lo, m, rounding_mode="floor") * m  # s ≡ p, >= lo
    return torch.where(hi >= first, torch.div(hi - first, m, rounding_mode="floor") + 1, 0)


def _per_head(p, cnt, ws, rs, sliding, num_heads) -> list:
    """per_head mode: the sum of ``cnt`` over the queries in class ``h % r_j`` of every config
    ``j`` of the subset, for each head ``h``."""
    if sliding or all(w % r == 0 for w, r in zip(ws, rs)):
        # classes are p % r_j: the head's classes hold iff p ≡ h (mod m) (CRT; h is a
        # solution), so one bincount of p % m serves every head
        m = math.lcm(*rs)
        sums = torch.bincount(p % m, weights=cnt.to(torch.float64), minlength=m)
        sums = sums.round().to(torch.int64).tolist()
        return [sums[h % m] for h in range(num_heads)]
    # rates not dividing their segments: group queries by their class vector, a mixed-radix
    # code (or, when that table would be large, the distinct vectors)
    radix = math.prod(rs)
    if radix <= 1 << 16:
        place = list(itertools.accumulate((1,) + tuple(rs[:-1]), operator.mul))
        code = sum(((p % w) % r) * rad for w, r, rad in zip(ws, rs, place))
        sums = torch.bincount(code, weights=cnt.to(torch.float64), minlength=radix)
        sums = sums.round().to(torch.int64).tolist()
        return [sums[sum((h % r) * rad for r, rad in zip(rs, place))] for h in range(num_heads)]
    cls = torch.stack([(p % w) % r for w, r in zip(ws, rs)])  # [|subset|, n]
    vecs, inv = torch.unique(cls, dim=1, return_inverse=True)
    sums = torch.bincount(inv, weights=cnt.to(torch.float64), minlength=vecs.shape[1])
    by_vec = dict(zip(map(tuple, vecs.t().tolist()), sums.round().to(torch.int64).tolist()))
    return [by_vec.get(tuple(h % r for r in rs), 0) for h in range(num_heads)]
