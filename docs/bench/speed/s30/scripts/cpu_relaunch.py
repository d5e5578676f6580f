"""Host time of one attention call on the CPU with the kernels' *fast* path: every Triton kernel
replaced by a stand-in that binds nothing and returns a compiled-kernel stand-in whose launch
does nothing, so a planned call's relaunches (``_launch.launch_all``) run as on a GPU after the
first call. What remains is our Python: the op, the prepared call, the runner, the guard and the
relaunch loop (Triton's C launcher, a few µs a launch on a GPU host, is left out).

OMP_NUM_THREADS=1 PYTHONPATH=<tree> python cpu_relaunch.py [S] [--profile] [--kv0] [--layer]
``--layer``: through the Transformers attention function of a Llama layer (9/3 x 64) as a model
calls it, not ``dilated_attention`` directly.
"""
import cProfile
import dataclasses
import os
import pstats
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402

import hf_hilbert_attn.kernels as K  # noqa: E402
import hf_hilbert_attn.kernels._launch as L  # noqa: E402
import hf_hilbert_attn.ops as ops  # noqa: E402
from hf_hilbert_attn import dilated_attention  # noqa: E402
from hf_hilbert_attn.patterns import as_pattern  # noqa: E402


class _Kernel:
    function = packed_metadata = None

    def run(self, *args):
        pass


class _Jit:
    def __init__(self, fn):
        self.arg_names = fn.arg_names

    def __getitem__(self, grid):
        return lambda *a, **k: _Kernel()


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda dev: 0)


def install():
    from hf_hilbert_attn.kernels import _bwd, _fwd  # (each kernel where its launch reads it)

    for m, n in ((_fwd, "_fwd_kernel"), (_bwd, "_dq_kernel"), (_bwd, "_dkdv_kernel")):
        setattr(m, n, _Jit(getattr(m, n)))
    L.JITFunction, L.driver, L._OK = _Jit, _Driver, True
    real = ops.use_triton
    ops.use_triton = lambda q, a, backend: backend == "triton" or real(q, a, backend)


def best_per_call(fwd, bwd, warmup=10, repeats=15, calls=50):
    """Seconds per call of ``fwd()`` and of ``bwd(out)`` (the best repeat of ``calls`` forwards,
    then their backwards), after ``warmup`` forward + backward pairs."""
    for _ in range(warmup):
        bwd(fwd())
    best_f = best_b = 1e9
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fwd() for _ in range(calls)]
        t1 = time.perf_counter()
        for o in outs:
            bwd(o)
        t2 = time.perf_counter()
        best_f, best_b = min(best_f, (t1 - t0) / calls), min(best_b, (t2 - t1) / calls)
    return best_f, best_b


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    seq = int(argv[0]) if argv else 4096
    torch.set_num_threads(1)
    install()
    pattern = as_pattern("default")
    if "--kv0" in sys.argv:
        pattern = dataclasses.replace(pattern, dense_kv_heads=(0,))
    mk = lambda h: torch.empty(1, h, seq, 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = mk(9), mk(3), mk(3)
    g = torch.ones(1, 9, seq, 64, dtype=torch.bfloat16)
    fwd = lambda: dilated_attention(q, k, v, pattern, backend="triton")
    bwd = lambda o: torch.autograd.grad(o, (q, k, v), g)
    best_f, best_b = best_per_call(fwd, bwd)
    print(f"S={seq} {pattern}: forward {best_f * 1e6:.1f} µs, backward {best_b * 1e6:.1f} µs "
          f"per call (relaunch path, launches stubbed, CPU)")
    if "--profile" in sys.argv:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            bwd(fwd())
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main()
