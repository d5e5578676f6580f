"""The planning facts of a pattern, in one place for every engine (Triton host code, the PyTorch
engines, the ring planner, the cache); the rule itself lives in ``pattern.py``. Conventions:

* configs are ``(w, r)`` pairs (segment length or window, rate); pattern-level functions name
  them by their index in ``pattern.configs``;
* **priority**: the union rule gives a pair to the first config (in :func:`priority`: by rate,
  then segment length, then index; repeats left out) that allows it, the sinks after every
  config. Any order computes the same function; this one lets the densest config (rate 1) keep
  all its pairs and run without a mask. "Earlier" configs come before a config in it;
* **ranges** are inclusive ``(lo, hi)``; range tests (integers or integer tensors) over-estimate
  (classes, gaps, documents ignored): no allowed pair is ever dropped;
* **span**: a config covered by another over every pair a call can hold adds nothing to that
  call (:func:`for_ranges`): at 4K tokens 2 of the default pattern's 6 sliding configs do all
  the work. Config ``i`` covers ``j`` over a call when ``r_i | r_j`` and every pair of ``j`` lies
  in a window/segment of ``i``: sliding, ``w_i >= min(w_j, reach + 1)`` (``reach`` the call's
  largest ``|p - s|``); segments, every position in the first segment of both (positions
  relative to a base that is a multiple of every segment length, as the kernels' plans use).
* a **class group** of config ``(w, r)`` is one dilation class of one segment (sliding windows:
  one class ``p % r`` of the whole sequence).

Dense key/value heads are split off above every engine (``dense_heads.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Optional, Tuple

__all__ = ["priority", "priority_configs", "period", "sink_keys", "config_meets", "meets",
           "class_uniform", "nests", "covers", "covered_window", "needed_configs", "for_ranges"]


def priority(pattern) -> Tuple[int, ...]:
    """Indices of ``pattern.configs`` in union priority: by rate, then segment length, then
    index; a config equal to an earlier one is left out."""
    first = {}  # config -> the index it first comes with, in priority order
    for i in sorted(range(pattern.num_configs),
                    key=lambda i: (pattern.dilation_rates[i], pattern.segment_lengths[i], i)):
        first.setdefault(pattern.configs[i], i)
    return tuple(first.values())


def priority_configs(pattern) -> list:
    """``[(w, r)]`` of the configs in :func:`priority` order."""
    return [pattern.configs[i] for i in priority(pattern)]


def period(pattern, limit: int = 0) -> int:
    """Shifting every position by a multiple of this leaves the configs' rule unchanged
    (``DilatedPattern.shift_period``; the sinks are not periodic). With ``limit``: 0 when the
    period reaches it (no usable period, e.g. a dense config at the kernels' position cap).
    ``pattern`` None: 0."""
    per = 0 if pattern is None else pattern.shift_period
    return 0 if limit and per >= limit else per


def sink_keys(pattern, klo: int, base: int = 0) -> int:
    """How many sink positions lie below ``sink_tokens`` relative to ``base`` (positions are
    ``true - base``) when the key range starting at ``klo`` holds one of them, else 0."""
    sinks = pattern.sink_tokens - base
    return sinks if sinks > 0 and klo < sinks else 0


def config_meets(w: int, sliding: bool, causal: bool, q_rng, k_rng):
    """Whether a config of segment length (or window) ``w`` may allow a pair between the query
    positions ``q_rng`` and the key positions ``k_rng`` (inclusive ranges; integers, or integer
    tensors elementwise): some segment holds positions of both (sliding: the ranges come within
    ``w``) and, causal, some key is not after some query. Exact for rate 1 on full ranges."""
    (qlo, qhi), (klo, khi) = q_rng, k_rng
    ok = (klo <= qhi) if causal else True
    if sliding:  # the closest pair of the two ranges lies within the window
        ok = ok & (qlo - khi < w)
        return ok if causal else ok & (klo - qhi < w)
    # some segment holds both; causal, its first key is then at or before the last query too
    return ok & (qlo // w <= khi // w) & (klo // w <= qhi // w)


def meets(pattern, causal: bool, q_rng, k_rng) -> bool:
    """Whether the pattern may allow a pair between these query and key position ranges: the key
    range holds a sink, or some config meets them (:func:`config_meets`); causal, some key is
    not after some query."""
    if sink_keys(pattern, k_rng[0]):  # (config_meets tests the causal order itself)
        return not (causal and k_rng[0] > q_rng[1])
    return any(config_meets(w, pattern.sliding, causal, q_rng, k_rng)
               for w in pattern.segment_lengths)


def class_uniform(earlier: Tuple[int, int], r: Optional[int], sliding: bool) -> bool:
    """Whether the class test of config ``earlier = (wj, rj)`` (``p ≡ s`` in its classes, and
    per_head the query's class) gives one answer over a class group of a config of rate ``r``:
    ``rj`` divides ``r``, and, segments, ``wj`` too (its classes do not shift from one of its
    segments to the next). ``r`` None (no one class: several groups, or the sinks): only rate 1.
    Sliding windows: the answer is then "allowed" for the group's pairs and heads; segments:
    the same for every pair and head of the group, whatever it is."""
    wj, rj = earlier
    return rj == 1 or (r is not None and r % rj == 0 and (sliding or wj % rj == 0))


def nests(wj: int, w: int, span: int) -> bool:
    """Whether runs of ``span`` positions starting at multiples of ``span`` inside segments of
    ``w`` never straddle a segment of ``wj``: ``wj`` divides ``w`` and ``span`` divides
    ``wj``."""
    return w % wj == 0 and wj % span == 0


def covers(earlier: Tuple[int, int], config: Tuple[int, int], sliding: bool) -> bool:
    """Whether config ``earlier`` allows every pair (and head) that ``config`` allows: its rate
    divides ``config``'s and its segments hold ``config``'s on class boundaries (``rj`` divides
    ``w``, ``w`` divides ``wj``); sliding, its window is at least as long."""
    (wj, rj), (w, r) = earlier, config
    return r % rj == 0 and (wj >= w if sliding else (w % rj == 0 and wj % w == 0))


def covered_window(earlier: Iterable[Tuple[int, int]], r: Optional[int]) -> int:
    """Sliding windows: the largest window ``wj`` of an ``earlier`` config that owns every pair
    of a class group of rate ``r`` (None: of any group) with ``|p - s| < wj``, or 0. Those are the
    class-uniform ones (:func:`class_uniform`), whose windows nest, so their union is the
    largest."""
    return max((wj for wj, rj in earlier if class_uniform((wj, rj), r, True)), default=0)


@lru_cache(maxsize=512)
def needed_configs(configs: tuple, sliding: bool, reach: int, hi: int) -> tuple:
    """Indices of the configs ``((w, r), ...)`` that no other config covers over a call whose
    pairs are at most ``reach`` apart and whose (relative) positions are ``<= hi``. Of configs
    that cover each other, the first is kept."""
    def covers(i, j):
        (wi, ri), (wj, rj) = configs[i], configs[j]
        return rj % ri == 0 and (wi >= min(wj, reach + 1) if sliding else hi < wi and hi < wj)

    n = len(configs)
    return tuple(j for j in range(n) if not any(covers(i, j) and not (covers(j, i) and i > j)
                                                for i in range(n) if i != j))


@lru_cache(maxsize=1024)
def replaced(base, ordering: str, **fields):
    # base.replace(**fields) once per layer or call; ordering in the key: equal patterns may
    # carry different layouts, the result keeps base's
    return base.replace(**fields)


def for_ranges(pattern, qlo: int, qhi: int, klo: int, khi: int, causal: bool):
    """``pattern`` without the configs another covers for queries at positions ``[qlo, qhi]``
    and keys at ``[klo, khi]`` (relative to a base that is a multiple of the pattern's period);
    the same object when none is dropped."""
    if pattern.num_configs == 1:
        return pattern
    reach = max(qhi - klo, 0) if causal else max(qhi - klo, khi - qlo, 0)
    cap = pattern.max_segment  # beyond the longest window the answer no longer changes
    key = (min(reach, cap), 0) if pattern.sliding else (0, min(max(qhi, khi), cap))
    keep = needed_configs(pattern.configs, pattern.sliding, *key)
    if len(keep) == pattern.num_configs:
        return pattern
    w, r = zip(*(pattern.configs[i] for i in keep))
    return replaced(pattern, pattern.ordering, segment_lengths=w, dilation_rates=r)
