"""Launching a planned kernel again without Triton's per-call binding.

``jit_fn[grid](*args)`` binds and specializes the arguments and builds a cache key: about
40 µs of host time per launch on an H200's host. A planned call repeats its launches with new
tensors of the same layout, so the compiled kernel is kept with a *guard* (each tensor's dtype
and 16-byte alignment, each integer's value); while it matches, the launch goes straight to
``CompiledKernel.run``, as ``JITFunction.run`` ends (checked once; the interpreter, recorded
launches and stubs take the plain path). The guard of a call's shared tensors is made once, and
their addresses read once: the launcher then gets integers, not tensors to ask for them. A
planned launch keeps its compiled kernel in a dict of its own (``launch_all``'s ``slot``): no
key over every argument per launch.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

__all__ = ["launch_all", "kept", "relaunch", "fast_launches_enabled"]

_OK: Optional[bool] = None
fast_launches = 0  # launches that skipped the binding (read by tests and benchmarks)


def fast_launches_enabled() -> bool:
    """Whether this Triton's ``JITFunction.run`` launches as :func:`launch_all` expects."""
    global _OK
    if _OK is None:
        try:
            src = inspect.getsource(JITFunction.run)
            _OK = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
                   "kernel.packed_metadata, launch_metadata," in " ".join(src.split())
                   and "return kernel" in src)
        except Exception:  # noqa: BLE001 - no source, another Triton: the plain path
            _OK = False
    return _OK


def _addresses(args: tuple) -> tuple:
    """``(guard, args)``: what Triton specializes ``args`` on, flat (tensors' dtype and 16-byte
    alignment, ints' values, bools apart from ints (``True == 1``), other values' types: floats
    none), and ``args`` with every tensor as its address (tuples as plain tuples): what Triton's
    launcher reads of a tensor, read here once for every launch that shares it."""
    guard, out = [], []
    _walk(args, guard, out)
    return tuple(guard), tuple(out)


def _walk(args, guard: list, out: list) -> None:
    for x in args:
        tx = type(x)
        if tx is int:
            guard.append(x)
        elif isinstance(x, torch.Tensor):
            ptr = x.data_ptr()
            guard.append((x.dtype, ptr & 15 == 0))
            x = ptr
        elif isinstance(x, tuple):
            sub = []
            _walk(x, guard, sub)
            x = tuple(sub)
        elif tx is bool:
            guard.append((bool, x))
        else:
            guard.append(tx)
        out.append(x)


def launch_all(launches) -> None:
    """``fn[grid](*head, *rest, **kwargs)`` for each ``(fn, grid, head, rest, kwargs, slot)``;
    after the first launch of a layout, without the binding. A head (the call's tensors, shared
    by its launches) is guarded and read as addresses once. ``slot``: a dict the launch owns,
    whose ``kwargs`` and ``rest`` but its last item are the same at every call; it keeps the
    compiled kernel by the head's guard and that item (the grid is no part of what Triton
    compiles), and ``rest`` as addresses. None: every launch binds (so do the interpreter,
    recorded launches and stubs)."""
    heads, stream = {}, None
    for fn, grid, head, rest, kwargs, slot in launches:
        if slot is None or not isinstance(fn, JITFunction) or not fast_launches_enabled():
            fn[grid](*head, *rest, **kwargs)
            continue
        h = heads.get(id(head))
        if h is None:
            if stream is None:
                device = driver.active.get_current_device()
                stream = driver.active.get_current_stream(device)
            h = heads[id(head)] = (device, *_addresses(head))
        key = (h[0], h[1], rest[-1] if rest else None)
        hit = slot.get(key)
        if hit is None:  # bind, then keep what a launch of this layout passes besides its args
            kernel = fn[grid](*head, *rest, **kwargs)
            names = fn.arg_names[len(head) + len(rest):]
            if kernel is not None and not hasattr(kernel, "result") and \
                    all(n in kwargs for n in names):  # (not: a recorded launch, a stub, a
                # parameter left to its default)
                if len(slot) >= 16:
                    slot.clear()
                slot[key] = (kernel, tuple(kwargs[n] for n in names), _addresses(rest)[1])
            continue
        kernel, tail, addressed = hit
        relaunch(kernel, (tuple(grid) + (1, 1))[:3], (*h[2], *addressed, *tail), stream)


def kept(slot: Optional[dict], grid, head: tuple, rest: tuple):
    """``(kernel, grid, arguments after the head's)`` that :func:`relaunch` repeats the launch of
    ``head + rest`` with (``slot``: :func:`launch_all`'s), or None where none was kept. The decode
    launcher, which guards its own head, relaunches it with the head's addresses alone."""
    hit = slot.get((driver.active.get_current_device(), _addresses(head)[0],
                    rest[-1] if rest else None)) if slot else None
    return None if hit is None else (hit[0], (tuple(grid) + (1, 1))[:3], (*hit[2], *hit[1]))


def relaunch(kernel, grid: tuple, values: tuple, stream=None) -> None:
    """Launch compiled ``kernel`` on ``grid`` (three sizes) with ``values`` (tensors as addresses,
    constexprs last) on the current stream (or ``stream``), as ``JITFunction.run`` ends."""
    global fast_launches
    fast_launches += 1
    if stream is None:
        stream = driver.active.get_current_stream(driver.active.get_current_device())
    enter = knobs.runtime.launch_enter_hook  # (None: launch_metadata is None too)
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata,
               None if enter is None else kernel.launch_metadata(grid, stream, *values), enter,
               knobs.runtime.launch_exit_hook, *values)
