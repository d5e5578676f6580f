"""Launching a planned kernel again without Triton's per-call binding.

``jit_fn[grid](*args)`` binds and specializes the arguments and builds a cache key: about
40 µs of host time per launch on an H200's host. A planned call repeats its launches with new
tensors of the same layout, so the compiled kernel is kept with a *guard* (each tensor's dtype
and 16-byte alignment, each integer's value); while it matches, the launch goes straight to
``CompiledKernel.run``, as ``JITFunction.run`` ends (checked once; the interpreter, recorded
launches and stubs take the plain path). The guard of a call's shared tensors is made once.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

__all__ = ["launch_all", "bind", "relaunch", "fast_launches_enabled"]

_FAST: dict = {}  # (fn, device, kwargs, guard) -> bind()'s (compiled kernel, constexpr values)
_MAX = 1024
_OK: Optional[bool] = None
fast_launches = 0  # launches that skipped the binding (read by tests and benchmarks)


def fast_launches_enabled() -> bool:
    """Whether this Triton's ``JITFunction.run`` launches as :func:`launch` expects."""
    global _OK
    if _OK is None:
        try:
            from triton.runtime.jit import JITFunction

            src = inspect.getsource(JITFunction.run)
            _OK = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
                   "kernel.packed_metadata, launch_metadata," in " ".join(src.split())
                   and "return kernel" in src)
        except Exception:  # noqa: BLE001 - no source, another Triton: the plain path
            _OK = False
    return _OK


def _guard(args: tuple) -> tuple:
    """What Triton specializes ``args`` on, flat: tensors' dtype and 16-byte alignment, ints'
    values, bools apart from ints (``True == 1``), other values' types (floats: none)."""
    out = []
    ap = out.append
    for x in args:
        tx = type(x)
        if tx is int:
            ap(x)
        elif isinstance(x, torch.Tensor):
            ap((x.dtype, x.data_ptr() & 15 == 0))
        elif isinstance(x, tuple):
            out.extend(_guard(x))
        elif tx is bool:
            ap((bool, x))
        else:
            ap(tx)
    return tuple(out)


def bind(fn, grid: tuple, args: tuple, kwargs: dict):
    """``fn[grid](*args, **kwargs)``; returns what :func:`relaunch` launches the same compiled
    kernel again with (tensors of the same dtypes and alignment, the same integers), or None
    where the plain path must serve every launch."""
    if not isinstance(fn, JITFunction) or not fast_launches_enabled():
        fn[grid](*args, **kwargs)
        return None
    kernel = fn[grid](*args, **kwargs)
    names = fn.arg_names[len(args):]
    if kernel is None or hasattr(kernel, "result") or any(n not in kwargs for n in names):
        return None  # a recorded launch, a stub, a parameter left to its default
    return kernel, tuple(kwargs[n] for n in names)


def relaunch(bound, grid: tuple, args: tuple) -> None:
    """Launch ``bound`` (:func:`bind`'s) on ``grid`` with ``args``, without the binding."""
    global fast_launches
    fast_launches += 1
    kernel, tail = bound
    values = (*args, *tail)
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
               kernel.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
               knobs.runtime.launch_exit_hook, *values)


def launch_all(launches) -> None:
    """``fn[grid](*head, *rest, **kwargs)`` for each ``(fn, grid, head, rest, kwargs)``; after
    the first launch of a layout, without the binding. The guard of a head (the call's tensors,
    shared by its launches) is made once; the grid is no part of what Triton compiles."""
    guards, device = {}, None
    for fn, grid, head, rest, kwargs in launches:
        if not isinstance(fn, JITFunction) or not fast_launches_enabled():
            fn[grid](*head, *rest, **kwargs)
            continue
        g = guards.get(id(head))
        if g is None:
            g = guards[id(head)] = _guard(head)
            device = driver.active.get_current_device() if device is None else device
        # kwargs in call-site order: one launcher builds them the same way every call
        key = (fn, device, tuple(kwargs.items()), g, _guard(rest))
        hit = _FAST.get(key)
        if hit is not None:
            relaunch(hit, grid, head + rest)
            continue
        bound = bind(fn, grid, head + rest, kwargs)
        if bound is not None:
            if len(_FAST) >= _MAX:
                _FAST.clear()
            _FAST[key] = bound
