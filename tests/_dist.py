"""Run a function on N gloo processes under pytest, with a bounded wall-clock time.

``run_distributed(fn, world_size, *args, timeout=...)`` starts ``world_size`` processes, each
initialising a gloo process group (file rendezvous in a temp dir, so parallel test runs never
fight over ports) and calling ``fn(rank, world_size, *args)``. ``fn`` must be a module-level
function of an importable module (a test module is fine). Returns the list of per-rank return
values (picklable). Any rank raising, dying, or not finishing within ``timeout`` seconds fails
the calling test with every rank's traceback; leftover processes are terminated — a hang costs
at most ``timeout``.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import tempfile
import time
import traceback

import torch.multiprocessing as mp

__all__ = ["run_distributed"]


def _worker(fn, rank, world, init_file, out_q, args, timeout, visible):
    try:
        # the caller's CUDA_VISIBLE_DEVICES (conftest hides CUDA from a multiprocess test's
        # processes): a rank has the fork server's environment, which is that of the test that
        # started the server, and CUDA reads the variable when a rank first uses it
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N processes share the CI machine's 2 cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=max(10, int(timeout * 0.8))))
        try:
            result = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - cleanup must not mask the real error
                pass
        out_q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report everything, including assertion errors
        out_q.put((rank, False, traceback.format_exc()))


# Modules every rank needs, imported once by the fork server instead of by each spawned rank
# (``import hf_hilbert_attn`` alone is seconds of CPU, and the suite starts ~60 ranks).
_PRELOAD = ["torch", "torch.distributed", "hf_hilbert_attn", "hf_hilbert_attn.ring"]
_CTX = None


def _context():
    """A "forkserver" context: each rank is forked from a clean server process that imported
    ``_PRELOAD`` (and no threads, CUDA or test state), started once per test process."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results.

    Raises:
        AssertionError: a rank failed (its traceback is included), died, or timed out.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        out_q = ctx.Queue()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, init_file, out_q, args, timeout, visible))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + timeout
        dead_since = None
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = out_q.get(timeout=0.2)
                results[rank] = (ok, payload)
                continue
            except queue_mod.Empty:
                pass
            # a rank that exited without reporting (crash): give the queue a moment, then stop
            if any(p.exitcode is not None and r not in results for r, p in enumerate(procs)):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 3.0:
                    break
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        errors = [f"--- rank {r} failed:\n{payload}"
                  for r, (ok, payload) in sorted(results.items()) if not ok]
        missing = [r for r in range(world_size) if r not in results]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            errors.append(f"--- ranks {missing} did not report within {timeout:.0f}s "
                          f"(exit codes {codes}; a hang or a crash)")
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return [results[r][1] for r in range(world_size)]
