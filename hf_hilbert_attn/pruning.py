"""The configs a call needs, given the span of its positions.

A config whose pairs another config already allows for every pair *this call can hold* adds
nothing to the union (a key counts once), so it is not launched. Over a short span that is
common: at 4K tokens 2 of the default pattern's 6 sliding configs do all the work (tested
against the reference in ``tests/test_pruning.py``).

Config ``i`` covers config ``j`` over a call when ``r_i`` divides ``r_j`` (``j``'s class
conditions then imply ``i``'s) and every pair of ``j`` in the call lies in a window/segment of
``i``: sliding, ``w_i >= min(w_j, reach + 1)`` (``reach`` the largest ``|p - s|`` of the call);
segments, every position of the call lies in the first segment of both (positions relative to a
base that is a multiple of every segment length, as the kernels' plans use).
"""

from __future__ import annotations

from functools import lru_cache

from .pattern import DilatedPattern

__all__ = ["needed_configs", "for_ranges"]


@lru_cache(maxsize=512)
def needed_configs(configs: tuple, sliding: bool, reach: int, hi: int) -> tuple:
    """Indices of the configs ``((w, r), ...)`` that no other config covers over a call whose
    pairs are at most ``reach`` apart and whose (relative) positions are ``<= hi``. Of configs
    that cover each other, the first is kept."""
    def covers(i, j):
        (wi, ri), (wj, rj) = configs[i], configs[j]
        if rj % ri:
            return False
        if sliding:
            return wi >= min(wj, reach + 1)
        return hi < wi and hi < wj

    keep = []
    for j in range(len(configs)):
        if not any(covers(i, j) and not (covers(j, i) and i > j)
                   for i in range(len(configs)) if i != j):
            keep.append(j)
    return tuple(keep)


@lru_cache(maxsize=256)
def _pruned(pattern: DilatedPattern, keep: tuple) -> DilatedPattern:
    return pattern.replace(segment_lengths=[pattern.segment_lengths[i] for i in keep],
                           dilation_rates=[pattern.dilation_rates[i] for i in keep])


def for_ranges(pattern: DilatedPattern, qlo: int, qhi: int, klo: int, khi: int,
               causal: bool) -> DilatedPattern:
    """``pattern`` without the configs another covers for queries at positions ``[qlo, qhi]``
    and keys at ``[klo, khi]`` (relative to a base that is a multiple of the pattern's period);
    the same object when none is dropped."""
    if pattern.num_configs == 1:
        return pattern
    reach = max(qhi - klo, 0) if causal else max(qhi - klo, khi - qlo, 0)
    cap = pattern.max_segment  # beyond the longest window the answer no longer changes
    if pattern.sliding:
        key = (min(reach, cap), 0)
    else:
        key = (0, min(max(qhi, khi), cap))
    keep = needed_configs(pattern.configs, pattern.sliding, *key)
    return pattern if len(keep) == pattern.num_configs else _pruned(pattern, keep)
