"""A bounded memo for host work that depends on positions only (plans), shared by the PyTorch
path and the kernels' host planning: every layer of a step attends at the same positions, so
the first layer's plan serves the others (FlashInfer's ``plan()`` / ``run()`` split).

A plan is keyed by plain values plus the position / document-id tensors it was made from: a CPU
tensor of at most ``SMALL`` elements by its content; any other by shape, dtype and device, and
on a hit checked against the tensor the plan was made from (the same object at the same version:
no sync; else equal content, compared with a kept copy): a stale plan is never returned.
Nothing is cached while ``torch.compile`` traces or a ``torch.func`` transform runs; inference
mode is part of every key (its tensors cannot be saved by autograd).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

__all__ = ["PlanCache", "caching_enabled", "kept", "memoised"]

SMALL = 64  # CPU tensors up to this many elements are keyed by their content


def caching_enabled() -> bool:
    """Whether plans may be memoised now (eager execution, no transform)."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


_MAKER: list = []  # the thread kept CUDA tensors are made on (started on first use)


def _on_maker(fn):
    """``fn()`` on that thread (at once when on it already: a nested call would wait on itself)."""
    if threading.current_thread().name.startswith("hf_hilbert_attn_maker"):
        return fn()
    if not _MAKER:
        _MAKER.append(ThreadPoolExecutor(1, thread_name_prefix="hf_hilbert_attn_maker"))
    return _MAKER[0].submit(fn).result()


def kept(make: Callable[[], object], device=None):
    """``make()`` of tensors a cache keeps (on CUDA: on that thread, between the caller stream's
    work before and after, never in a graph pool the caller's thread fills: "reduce-overhead")."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return make()
    idx = torch.cuda.current_device() if device.index is None else device.index
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(idx))

    def run():
        with torch.cuda.device(idx):
            torch.cuda.current_stream().wait_event(ready)
            out, done = make(), torch.cuda.Event()
            done.record()
        return out, done

    out, done = _on_maker(run)
    torch.cuda.current_stream(idx).wait_event(done)
    return out


def memoised(memo: dict, key, size: int, make: Callable[[], object]):
    """``memo[key]``, made by ``make()`` where absent: a plain dict of at most ``size`` entries,
    emptied when full (small tables made once, not per call)."""
    if (hit := memo.get(key)) is None:
        if len(memo) >= size:
            memo.clear()
        hit = memo[key] = make()
    return hit


def _fingerprint(t: Optional[torch.Tensor]):
    if t is None:
        return None
    content = tuple(t.reshape(-1).tolist()) if t.device.type == "cpu" and t.numel() <= SMALL \
        else None
    return (tuple(t.shape), t.dtype, t.device, content)


class _Guard:
    """What a cached plan was made from, for one tensor too large to key by content."""

    __slots__ = ("ref", "version", "copy")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.version = None if t.is_inference() else t._version
        self.copy = t.detach().clone()

    def matches(self, t: torch.Tensor) -> bool:
        if self.version is not None and self.ref() is t and t._version == self.version:
            return True
        if not torch.equal(self.copy, t):
            return False
        # the same content in another tensor (or after an in-place write that restored it):
        # the next call with this tensor is an identity hit
        self.ref, self.version = weakref.ref(t), None if t.is_inference() else t._version
        return True


class PlanCache:
    """At most ``size`` keys, least recently used dropped first; per key at most ``per_key``
    plans (tensors of one shape with different content)."""

    def __init__(self, size: int, per_key: int = 4):
        self.size, self.per_key = size, per_key
        self._entries: "OrderedDict[tuple, list]" = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def get_or_make(self, key: tuple, tensors: Sequence[Optional[torch.Tensor]],
                    make: Callable[[], object]):
        """The plan for ``key`` and ``tensors`` (a sequence of tensors or None), made by
        ``make()`` when none is cached (and then kept, unless caching is off now)."""
        if not caching_enabled():
            return make()
        prints = tuple(_fingerprint(t) for t in tensors)
        full = (key, torch.is_inference_mode_enabled(), prints)
        bucket = self._entries.get(full)
        for n, (guards, plan) in enumerate(bucket or ()):
            if all(g is None or g.matches(t) for g, t in zip(guards, tensors)):
                self._entries.move_to_end(full)
                bucket.insert(0, bucket.pop(n))  # (most recently used first)
                return plan
        plan = kept(make, next((t.device for t in tensors if t is not None), None))
        bucket = self._entries.setdefault(full, [])
        self._entries.move_to_end(full)
        while len(self._entries) > self.size:  # (a new key: the least recently used goes)
            self._entries.popitem(last=False)
        guards = tuple(None if t is None or p[3] is not None else _Guard(t)
                       for t, p in zip(tensors, prints))
        bucket.insert(0, (guards, plan))
        del bucket[self.per_key:]
        return plan
