"""A forward's and a backward's host time by level inside a training step on CPU, the kernels
stubbed: the attention function, ``ops.dilated_attention``, its key and autocast test,
``Function.apply``, the Function's forward, ``kernels.dilated_fwd`` and the pieces of
``dilated_bwd`` (written for the commit before the prepared calls of D70: run it on that tree).

OMP_NUM_THREADS=1 PYTHONPATH=<tree> python cpu_stub_levels.py [SEQ]     (from the repository)
"""
import gc
import os
import sys
import time
import types
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_stub_insitu import report, setup, steps, timed  # noqa: E402 (the timing helpers)

import torch  # noqa: E402

import hf_hilbert_attn.kernels as K  # noqa: E402
import hf_hilbert_attn.ops as ops  # noqa: E402

m, ids = setup(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
ops.dilated_attention = timed("1 ops.dilated_attention", ops.dilated_attention)
sys.modules["hf_hilbert_attn.integrations.transformers"].dilated_attention = ops.dilated_attention
ops._prepared_key = timed("1a prepared_key", ops._prepared_key)
ops.call_under_autocast = timed("1b call_under_autocast", ops.call_under_autocast)
_timed_apply = timed("1c Function.apply", ops._EagerKernels.apply)


class EK(ops._EagerKernels):  # its apply timed
    pass


EK.apply = classmethod(lambda cls, *a: _timed_apply(*a))
ops._EagerKernels.forward = staticmethod(timed("2 Function.forward", ops._EagerKernels.forward))
ops._EagerKernels = EK
K.dilated_fwd = timed("3 dilated_fwd", K.dilated_fwd)
K.dilated_bwd = timed("6 dilated_bwd", K.dilated_bwd)
K._run = timed("4/7 _run (stub launches)", K._run)
for n in ("_call_plans", "_sum_buffers", "_bwd_stats", "_fill_skipped", "_prep", "_strided",
          "_check_target", "kernel_config", "_scales"):
    setattr(K, n, timed("k." + n, getattr(K, n)))
K.torch = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch)
                                   if not n.startswith("__")})
for n in ("zeros", "empty", "empty_like"):
    setattr(K.torch, n, timed("k.torch." + n, getattr(torch, n)))
steps(m, ids, 3)
report(3)
G = {"t": 0.0, "n": Counter()}  # the cyclic garbage collector's share of a step


def collected(phase, info):
    if phase == "start":
        G["s"] = time.perf_counter()
    else:
        G["t"] += time.perf_counter() - G["s"]
        G["n"][info["generation"]] += 1


gc.callbacks.append(collected)
t0 = time.perf_counter()
steps(m, ids, 3, warmup=0)
print(f"wall {(time.perf_counter() - t0) / 3 * 1e3:.0f} ms/step, gc {G['t'] * 1e3 / 3:.2f} "
      f"ms/step {dict(G['n'])}")
