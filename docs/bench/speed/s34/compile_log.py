"""A pytest plugin (``-p compile_log``, this folder on ``PYTHONPATH``): every Triton compile of
the run as one JSON line in ``$COMPILE_LOG`` — the worker, the test running, the kernel, its
cache key, whether the cache had it, the compile's seconds and its constexprs / signature —
to find what a cold GPU suite spends its time compiling."""

import json
import os
import threading

_TEST = {"id": None}
_LOCK = threading.Lock()


def _listener(*, src, metadata, metadata_group, times, cache_hit, **_):
    fn = getattr(src, "fn", None)
    name = getattr(fn, "__name__", None) or str(getattr(src, "name", "?"))
    consts = getattr(src, "constants", {}) or {}
    sig = getattr(src, "signature", {}) or {}
    row = dict(pid=os.getpid(), test=_TEST["id"], kernel=name, hash=metadata.get("hash"),
               hit=bool(cache_hit), s=round(getattr(times, "total", 0) / 1e6, 3),
               consts={str(k): repr(v)[:200] for k, v in consts.items()},
               sig={str(k): str(v) for k, v in sig.items()},
               warps=metadata.get("num_warps"), stages=metadata.get("num_stages"))
    with _LOCK, open(os.environ["COMPILE_LOG"], "a") as f:
        f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    try:
        import triton

        triton.knobs.compilation.listener = _listener
    except (ImportError, AttributeError):
        pass


def pytest_runtest_setup(item):
    _TEST["id"] = item.nodeid
