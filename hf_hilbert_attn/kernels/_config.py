"""The kernels' configuration, read from the environment once, and the run step of a planned
call: its launches, compiled side by side the first time, or handed to a launch hook.

The configuration is explicit: :func:`kernel_config` reads it on first use (not at import),
:func:`configure` replaces it (tests, tile searches, the compile check), and every planned
call is keyed by the configuration it was planned with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import triton

from ._launch import launch_all

__all__ = ["KernelConfig", "kernel_config", "configure", "configured", "set_launch_hook"]

_KINDS = ("fwd", "fwd1", "dq", "dkdv")


def _env_int(name: str, default: int, unit: str = "bytes") -> int:
    if not (env := os.environ.get(name, "")):
        return default
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"{name} must be a positive number of {unit}, got {env!r}")
    return int(env)


def _env_blocks() -> Optional[dict]:
    """The tile override from ``HF_HILBERT_{FWD,FWD1,DQ,DKDV}_BLOCKS=BM,BN,warps,stages`` (tile
    searches run one process per setting), or None when none is set."""
    found = {}
    for kind in _KINDS:
        name = f"HF_HILBERT_{kind.upper()}_BLOCKS"
        if env := os.environ.get(name, ""):
            try:
                found[kind] = tuple(int(x) for x in env.split(","))
            except ValueError:
                found[kind] = ()
            if len(found[kind]) != 4:
                raise ValueError(f"{name} must be BM,BN,warps,stages (four integers), got {env!r}")
    return found or None


def _blocks_key(blocks) -> Optional[tuple]:
    """A tile override as a hashable value: None, ``(BM, BN[, warps, stages])``, or the sorted
    ``(kind, tile)`` items of a per-kind dict."""
    if blocks is None:
        return None
    if isinstance(blocks, dict):
        if bad := [kind for kind in blocks if kind not in _KINDS]:
            raise ValueError(f"tile override kinds are {_KINDS}, got {bad[0]!r}")
        return tuple(sorted((kind, tuple(t)) for kind, t in blocks.items()))
    return tuple(blocks)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Settings of the kernels' host code (each part of every planned call's key).

    Attributes:
        blocks: the tile override: None (``_plan``'s tuned sizes), ``(BM, BN[, warps, stages])``
            for every kernel (tests: small tiles reach every boundary case), or per kind
            ``{"fwd" | "fwd1" | "dq" | "dkdv": tile}`` ("fwd1": the forward launch without an
            earlier config). Environment: ``HF_HILBERT_{FWD,FWD1,DQ,DKDV}_BLOCKS``.
        acc_bytes: largest float32 buffer (bytes) summing partial results over configs (the
            forward's, dq's, dk's and dv's); heads go in chunks beyond it
            (``HF_HILBERT_ACC_BYTES``).
        compile_threads: threads compiling a call's kernels side by side the first time it runs
            (10-20 specializations of ~5 s; 1: in turn at launch; ``HF_HILBERT_COMPILE_THREADS``).
        smem: shared memory per program the tiles are chosen for (bytes; None: the GPU's own;
            the compile check plans another GPU's launches with it).
        interpret: the Triton interpreter runs the kernels (``TRITON_INTERPRET=1``).
        skip_rows: query rows (``B * Sq``) from which a call leaves out skipped heads between
            computed ones (a launch more per config); below, it computes them (D41).
    """

    blocks: Optional[tuple] = None
    acc_bytes: int = 4 << 30
    compile_threads: int = 1
    smem: Optional[int] = None
    interpret: bool = False
    skip_rows: int = 16384

    def __post_init__(self):
        object.__setattr__(self, "blocks", _blocks_key(self.blocks))
        # part of every call's key: hashed once, not per call
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self):
        return self._hash

    @classmethod
    def from_env(cls) -> "KernelConfig":
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return cls(blocks=_env_blocks(), acc_bytes=_env_int("HF_HILBERT_ACC_BYTES", 4 << 30),
                   compile_threads=_env_int("HF_HILBERT_COMPILE_THREADS", min(8, cpus or 1),
                                            "threads"),
                   interpret=os.environ.get("TRITON_INTERPRET", "0") == "1")

    def tile_override(self, kind: str, first: bool) -> Optional[tuple]:
        """The override of a launch of ``kind`` (``first``: without an earlier config), or
        None."""
        over = self.blocks
        if over and isinstance(over[0], tuple):
            per_kind = dict(over)
            return (first and per_kind.get("fwd1")) or per_kind.get(kind)
        return over


_CONFIG: Optional[KernelConfig] = None


def kernel_config() -> KernelConfig:
    """The configuration in force: read from the environment on first use."""
    global _CONFIG
    _CONFIG = KernelConfig.from_env() if _CONFIG is None else _CONFIG
    return _CONFIG


def configure(config: Optional[KernelConfig] = None, **changes) -> KernelConfig:
    """Put ``config`` (or the current configuration with ``changes``, field names of
    :class:`KernelConfig`) in force; returns the one it replaces."""
    global _CONFIG
    old = kernel_config()
    _CONFIG = dataclasses.replace(config if config is not None else old, **changes)
    return old


@contextlib.contextmanager
def configured(**changes):
    """:func:`configure` for the block, the previous configuration restored after it."""
    old = configure(**changes)
    try:
        yield kernel_config()
    finally:
        configure(old)


# Receives each call's launches instead of running them (the compile check records them).
_LAUNCH_HOOK: Optional[Callable] = None


def set_launch_hook(hook: Optional[Callable]) -> Optional[Callable]:
    """``hook(launches)`` gets the launches ``[(jit_fn, grid, args, kwargs)]`` of every call
    instead of the GPU (None: launch them); returns the hook it replaces."""
    global _LAUNCH_HOOK
    old, _LAUNCH_HOOK = _LAUNCH_HOOK, hook
    return old


_POOL: Optional[ThreadPoolExecutor] = None


def _compile_together(launches, cfg: KernelConfig) -> None:
    """Compile the kernels of ``launches`` (``(jit_fn, grid, args, kwargs)``) in a thread pool
    (Triton's ``AsyncCompileMode``: one compile per distinct specialization, finished before
    this returns); the launches then find them in Triton's cache. A no-op in the interpreter,
    with one thread, or for stand-ins of the kernels (``host_overhead.py --stub``)."""
    global _POOL
    if (cfg.compile_threads < 2 or cfg.interpret or len(launches) < 2
            or not hasattr(launches[0][0], "warmup") or _async_active()):
        return
    if _POOL is None or _POOL._max_workers != cfg.compile_threads:
        _POOL = ThreadPoolExecutor(cfg.compile_threads, thread_name_prefix="hf_hilbert_compile")
    with triton.AsyncCompileMode(_POOL):
        for fn, grid, args, kwargs in launches:
            fn.warmup(*args, grid=grid, **kwargs)


def _async_active() -> bool:
    """Whether the caller has a Triton ``AsyncCompileMode`` of its own open (modes do not nest:
    the launches then compile as usual)."""
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:  # a Triton without it: compile at launch
        return True
    return active_mode.get() is not None


def _run(launches, fresh: bool, cfg: KernelConfig, memo: Optional[dict] = None):
    """Launch ``(jit_fn, grid, head, rest, kwargs)`` (arguments ``head + rest``) in order
    (``memo``: ``launch_all``'s, whose result it returns), or hand the hook ``(jit_fn, grid,
    args, kwargs)``; ``fresh``: compile them side by side first."""
    if _LAUNCH_HOOK is not None or fresh:
        flat = [(fn, grid, head + rest, kw) for fn, grid, head, rest, kw in launches]
        if _LAUNCH_HOOK is not None:
            _LAUNCH_HOOK(flat)
            return None
        _compile_together(flat, cfg)
    return launch_all(launches, memo)
