"""A pytest plugin that logs every Triton compile of a test run (``-p compile_log`` with this
folder on ``PYTHONPATH``, ``COMPILE_LOG=DIR``): per xdist worker, one JSON line per compile or
cache hit with the test running, the kernel, its specialization hash, constexprs and seconds.
Session 43 used it to see where the GPU suite's cold compile time goes."""
import json
import os
import time


def _seconds(times):
    out = getattr(times, "total", None)
    if out is not None:
        return out / 1e6 if out > 1e3 else out  # (microseconds in some versions)
    out = 0.0
    for name in ("ir_initialization", "store_results"):
        out += getattr(times, name, 0) or 0
    for stage in getattr(times, "lowering_stages", ()) or ():
        out += stage[1] if isinstance(stage, (tuple, list)) else 0
    return out / 1e6 if out > 1e3 else out  # (microseconds in some versions)


def pytest_configure(config):
    out = os.environ.get("COMPILE_LOG")
    if not out:
        return
    from triton import knobs

    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = os.path.join(out, f"compile_{worker}.jsonl")

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        try:
            rec = dict(worker=worker, test=os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                       name=getattr(src, "name", "?"), hash=src.hash(), hit=bool(cache_hit),
                       end=time.time(), s=_seconds(times),
                       const=str(getattr(src, "constants", ""))[:400])
        except Exception as e:  # noqa: BLE001 - a log line, never a failure
            rec = dict(worker=worker, error=repr(e), end=time.time())
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    knobs.compilation.listener = listener
