"""Perplexity as a function of context length, with strided windows.

For context length ``L`` and stride ``s``, windows ``[b, b + L)`` start at ``b = 0, s, 2s, …``;
each window scores only the tokens no earlier window scored (its last ``s`` tokens; all of the
first window), so every token of the stream is scored exactly once, each with between
``L - s`` and ``L - 1`` tokens of context (the first window: fewer)::

    stream   t0 t1 t2 t3 t4 t5 t6 t7 t8 t9        L = 6, s = 2
    window0  [x  S  S  S  S  S]                   x: context only, S: scored
    window1        [x  x  x  x  S  S]
    window2              [x  x  x  x  S  S]

Perplexity = exp(sum of scored negative log-likelihoods / number of scored tokens).

Long windows of a ``hilbert_dilated`` model run as a chunked prefill through a
:class:`~hf_hilbert_attn.PatternCache` (``prefill_chunk``, default ``"auto"``): the same function,
with memory bounded by the pattern and the chunk instead of the window, so a 1M-token window
fits on one GPU. ``sdpa`` models keep one full forward per window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections import OrderedDict
from typing import Iterator, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from hf_hilbert_attn.integrations.cache import (DEFAULT_PREFILL_CHUNK, prefill_chunks,
                                                uses_pattern_attention)

__all__ = ["strided_windows", "window_nll", "PerplexityResult", "evaluate_perplexity",
           "resolve_prefill_chunk", "perplexity_batched"]

PrefillChunk = Union[str, int, None]


def resolve_prefill_chunk(model, length: int,
                          prefill_chunk: PrefillChunk = "auto") -> Optional[int]:
    """Tokens per forward when a ``length``-token input runs as a chunked prefill, or None for
    one forward. ``"auto"``: :data:`~hf_hilbert_attn.integrations.cache.DEFAULT_PREFILL_CHUNK`
    for a ``hilbert_dilated`` model (through a ``PatternCache``: exact, memory bounded by the
    pattern) whose input is longer, else None; None or 0: one forward; an int ``>= 1``: chunks
    of that size (through a ``PatternCache``, or a ``DynamicCache`` for other attention)."""
    if prefill_chunk == "auto":
        pattern = uses_pattern_attention(model)
        return DEFAULT_PREFILL_CHUNK if pattern and length > DEFAULT_PREFILL_CHUNK else None
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, type(None))) \
            or (prefill_chunk or 0) < 0:
        raise ValueError(f"prefill_chunk must be 'auto', None or an integer >= 0, got "
                         f"{prefill_chunk!r}")
    return prefill_chunk or None


def strided_windows(num_tokens: int, length: int, stride: int) -> Iterator[Tuple[int, int, int]]:
    """Yield ``(begin, end, num_scored)`` for each window; the scored tokens are the last
    ``num_scored`` of ``[begin, end)`` (the first window: all but its first token).

    Raises:
        ValueError: ``length < 2``, ``stride`` not in ``[1, length - 1]`` (a window's first token
            is predicted from outside the window, so a stride of ``length`` would skip it), or
            fewer than 2 tokens.
    """
    if length < 2:
        raise ValueError(f"context length must be >= 2, got {length}")
    if not 1 <= stride <= length - 1:
        raise ValueError(f"stride must be in [1, context length - 1 = {length - 1}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + length, num_tokens)
        scored = end - prev_end
        if begin == 0:
            scored -= 1  # the stream's first token has nothing to be predicted from
        yield begin, end, scored
        prev_end = end
        if end == num_tokens:
            break


@torch.inference_mode()
def window_nll(model, input_ids: torch.Tensor, num_scored: int, *, chunk: int = 4096,
               prefill_chunk: PrefillChunk = "auto") -> float:
    """Sum of the negative log-likelihoods of the last ``num_scored`` tokens of ``input_ids``.

    Only the logits that predict scored tokens are materialised (``logits_to_keep``, where the
    model accepts it), and the float32 cross-entropy runs in chunks of ``chunk`` positions, so
    memory outside the model is ``O(num_scored × vocab)`` at the model's dtype.

    Args:
        model: a causal LM.
        input_ids: ``[1, L]``.
        num_scored: ``1 <= num_scored <= L - 1``.
        prefill_chunk: run the window as a chunked prefill (:func:`resolve_prefill_chunk`);
            each chunk keeps only its logits that predict scored tokens.

    Returns:
        The summed NLL (natural log) as a Python float.
    """
    L = input_ids.shape[1]
    if not 1 <= num_scored <= L - 1:
        raise ValueError(f"num_scored must be in [1, {L - 1}], got {num_scored}")
    keep = num_scored + 1  # logits at positions L-keep .. L-2 predict tokens L-num_scored .. L-1
    step = resolve_prefill_chunk(model, L, prefill_chunk)
    if step:
        total = 0.0
        for begin, end, logits in prefill_chunks(model, input_ids, chunk_tokens=step,
                                                 logits_from=L - keep):
            if logits is not None:  # positions max(begin, L - keep) .. end - 1
                lo, hi = max(begin, L - keep), min(end, L - 1)
                total += _nll_sum(logits[0, :hi - lo], input_ids[0, lo + 1:hi + 1], chunk)
        return total
    try:
        logits = model(input_ids=input_ids, logits_to_keep=keep, use_cache=False).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(input_ids=input_ids, use_cache=False).logits
    return _nll_sum(logits[0, -keep:-1], input_ids[0, L - num_scored:], chunk)


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> float:
    # float32 cross-entropy, ``chunk`` positions at a time
    total = 0.0
    for i in range(0, len(targets), chunk):
        total += float(F.cross_entropy(logits[i:i + chunk].float(), targets[i:i + chunk],
                                       reduction="sum"))
    return total


@dataclass
class PerplexityResult:
    length: int
    stride: int
    nll_sum: float
    scored_tokens: int
    processed_tokens: int
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.scored_tokens)


def evaluate_perplexity(model, tokens: torch.Tensor, length: int, stride: int, *,
                        progress=None, prefill_chunk: PrefillChunk = "auto") -> PerplexityResult:
    """Perplexity of ``model`` over the token stream ``tokens`` ``[N]`` with ``length``-token
    windows every ``stride`` tokens (see the module docstring).

    Args:
        progress: an optional tqdm bar, advanced once per window.
        prefill_chunk: long windows as a chunked prefill (:func:`resolve_prefill_chunk`).
    """
    device = next(model.parameters()).device
    nll, scored_total, processed, windows = 0.0, 0, 0, 0
    for begin, end, scored in strided_windows(int(tokens.numel()), length, stride):
        ids = tokens[begin:end].unsqueeze(0).to(device)
        nll += window_nll(model, ids, scored, prefill_chunk=prefill_chunk)
        scored_total += scored
        processed += end - begin
        windows += 1
        if progress is not None:
            progress.update(1)
    return PerplexityResult(length, stride, nll, scored_total, processed, windows)


def count_windows(num_tokens: int, length: int, stride: int) -> int:
    return sum(1 for _ in strided_windows(num_tokens, length, stride))


@torch.inference_mode()
def perplexity_batched(model, tokens: torch.Tensor, length: int, stride: int, *,
                       max_batch_tokens: int = 65536, progress=None) -> PerplexityResult:
    """:func:`evaluate_perplexity` with windows batched (the quality study's measure).

    The windows (and so the scored tokens) are those of ``strided_windows``; windows of equal
    size and scored count run together, ``[B, L]`` with ``B * L <= max_batch_tokens``, and only
    the logits predicting scored tokens are kept (``logits_to_keep``; about
    ``max_batch_tokens / 2 × vocab`` values at stride ``L/2``). The cross-entropy is float32.
    """
    device = next(model.parameters()).device
    groups: "OrderedDict[Tuple[int, int], List[int]]" = OrderedDict()
    for begin, end, scored in strided_windows(int(tokens.numel()), length, stride):
        groups.setdefault((end - begin, scored), []).append(begin)
    nll, scored_total, processed, windows = 0.0, 0, 0, 0
    for (size, scored), begins in groups.items():
        per = max(1, max_batch_tokens // size)
        for i in range(0, len(begins), per):
            chunk = begins[i:i + per]
            ids = torch.stack([tokens[b:b + size] for b in chunk]).to(device)  # [B, size]
            logits = model(input_ids=ids, logits_to_keep=scored + 1, use_cache=False).logits
            logits = logits[:, -(scored + 1):-1].flatten(0, 1)  # [B * scored, V]
            targets = ids[:, size - scored:].flatten()
            for j in range(0, targets.numel(), 4096):
                nll += float(F.cross_entropy(logits[j:j + 4096].float(), targets[j:j + 4096],
                                             reduction="sum"))
            scored_total += scored * len(chunk)
            processed += size * len(chunk)
            windows += len(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return PerplexityResult(length, stride, nll, scored_total, processed, windows)
