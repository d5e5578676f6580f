"""Launching a planned call's kernels again without Triton's per-call binding.

``jit_fn[grid](*args)`` binds and specializes the arguments and builds a cache key: about
40 µs of host time per launch on an H200's host. A planned call repeats its launches with new
tensors of the same layout, so its compiled kernels are kept with a *guard* (each tensor's
dtype and 16-byte alignment, each integer's value); while it matches, the launches go straight
to ``CompiledKernel.run``, as ``JITFunction.run`` ends (checked once; the interpreter, recorded
launches and stubs take the plain path). The guard of a call's tensors is made once per call,
and their addresses read once: the launcher then gets integers, not tensors to ask for them,
and the call one dict lookup, not one per launch.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from triton import __version__ as _triton_version, knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from ..plan_cache import memoised
from ._common import Strided

__all__ = ["launch_all", "relaunch", "relaunch_kept", "fast_launches_enabled"]

_OK: Optional[bool] = None
_TRITON_36 = _triton_version.startswith("3.6.")  # (its launcher, as _c_launch reads it)
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
        elif tx is Strided:  # (most of a call's arguments: a tensor and three ints)
            ptr = x[0].data_ptr()
            guard += ((x[0].dtype, ptr & 15 == 0), x[1], x[2], x[3])
            x = (ptr, x[1], x[2], x[3])
        elif isinstance(x, torch.Tensor):
            ptr = x.data_ptr()
            guard.append((x.dtype, ptr & 15 == 0))
            x = ptr
        elif isinstance(x, tuple):
            sub = []
            _walk(x, guard, sub)
            x = tuple(sub)
        else:  # (a bool apart from an int: True == 1)
            guard.append((bool, x) if tx is bool else tx)
        out.append(x)


def launch_all(launches, memo: Optional[dict] = None):
    """``fn[grid](*head, *rest, **kwargs)`` for each ``(fn, grid, head, rest, kwargs)`` in order.
    ``memo``: a dict the planned call owns (its launches and their ``rest`` and ``kwargs`` are
    the same at every call). Its first call of a layout binds each launch and keeps, by the guard
    of the call's heads (each distinct head, the call's tensors, guarded and read as addresses
    once), the compiled kernels with the arguments after their head; later calls of that layout
    hand Triton's launcher the heads' addresses and those. Returns what it kept for this layout
    (``[(kernel, grid, arguments after the head)]``), or None: every launch bound (no memo, the
    interpreter, recorded launches and stubs)."""
    if memo is None or not fast_launches_enabled() or \
            not all(isinstance(launch[0], JITFunction) for launch in launches):
        for fn, grid, head, rest, kwargs in launches:
            fn[grid](*head, *rest, **kwargs)
        return None
    heads = {i: _addresses(h) for i, h in {id(ln[2]): ln[2] for ln in launches}.items()}
    key = (driver.active.get_current_device(), *(guard for guard, _ in heads.values()))
    if (kept := memo.get(key)) is None:  # bind each launch (compiling where needed) and keep
        # what a launch of this layout passes besides its head; nothing where one cannot be
        # repeated so (a recorded launch, a stub, a parameter left to its default)
        kept = []
        for fn, grid, head, rest, kwargs in launches:
            kernel = fn[grid](*head, *rest, **kwargs)
            names = fn.arg_names[len(head) + len(rest):]
            if kernel is None or hasattr(kernel, "result") or not all(n in kwargs for n in names):
                kept = None
            elif kept is not None:
                kept.append((kernel, (tuple(grid) + (1, 1))[:3],
                             (*_addresses(rest)[1], *(kwargs[n] for n in names))))
        return kept if kept is None else memoised(memo, key, 16, lambda: kept)  # (bounded)
    stream = driver.active.get_current_stream(key[0])
    for (kernel, grid, tail), launch in zip(kept, launches):
        relaunch(kernel, grid, (*heads[id(launch[2])][1], *tail), stream)
    return kept


def relaunch_kept(kept, heads: tuple) -> None:
    """Launch again what :func:`launch_all` kept for a layout (``[(kernel, grid, arguments
    after the head)]``, in order), launch ``i`` with the head values ``heads[which[i]]``
    (``kept`` as ``[(kernel, grid, tail, which)]``: a caller that knows its heads' layout is the
    one they were kept for builds their values itself, with no guard)."""
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    for kernel, grid, tail, which in kept:
        relaunch(kernel, grid, (*heads[which], *tail), stream)


def relaunch(kernel, grid: tuple, values: tuple, stream=None) -> None:
    """Launch compiled ``kernel`` on ``grid`` (three sizes) with ``values`` (tensors as addresses,
    constexprs last) on the current stream (or ``stream``), as ``JITFunction.run`` ends; with no
    launch hook set, through its launcher's C function where :func:`_c_launch` finds one."""
    global fast_launches
    fast_launches += 1
    if stream is None:
        stream = driver.active.get_current_stream(driver.active.get_current_device())
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    c = (_C.get(kernel) or _c_launch(kernel)) if enter is None and leave is None else (None,)
    if c[0] is not None:
        return c[0](*grid, stream, kernel.function, *c[1], *values)
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata,
               None if enter is None else kernel.launch_metadata(grid, stream, *values), enter,
               leave, *values)


_C: dict = {}  # compiled kernel -> _c_launch(kernel)


def _c_launch(kernel) -> tuple:
    """``(C function, its arguments between the kernel's function and its values)`` of compiled
    ``kernel``'s launcher where the launcher's call adds only these (Triton 3.6's
    ``CudaLauncher`` with no scratch memory): two Python frames less a launch; else ``(None,)``."""
    run = kernel.run
    if type(run).__name__ != "CudaLauncher" or not _TRITON_36 or run.global_scratch_size \
            or run.profile_scratch_size:
        return _C.setdefault(kernel, (None,))
    return _C.setdefault(kernel, (run.launch, (run.launch_cooperative_grid, run.launch_pdl, None,
                                               None, kernel.packed_metadata, None, None, None)))


def _hook(hook):
    """Triton's launch hook ``hook``, or None where it is an empty chain of hooks (Triton 3.6
    keeps a chain, never None: handed to the launcher, it is called twice a launch, and the
    launch metadata built for it, for nothing)."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook
