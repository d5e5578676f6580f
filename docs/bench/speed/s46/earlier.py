"""The Gluon dk/dv kernel on launches with earlier configs (no per-pair union mask: not MIXED;
session 46) against the Triton dk/dv kernel on those launches, in one process: per kernel GPU
ms (profiler), fwd+bwd ms (do_bench) and the gradients' largest difference ÷ largest gradient.

    python docs/bench/speed/s46/earlier.py 32/8/128:65536@pow2 32/8/128:65536@longnet_lm

``triton`` runs the plan with the kernel's eligibility as before (no earlier config), so only
those launches change; the profiler names the Gluon kernel ``dkdv_wgmma``.
"""
import os
import sys

import torch
import triton

from hf_hilbert_attn.kernels import _calls, _dkdv_wgmma, configure

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "s44"))
from tiles import cases, measure  # noqa: E402

NEW = _dkdv_wgmma.eligible


def old(flags, c):
    return not flags.EARLIER and NEW(flags, c)


def main():
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for label, step, qkv in cases(sys.argv[1:]):
        print(f"== {label}", flush=True)
        base = None
        for name, rule in (("gluon earlier", NEW), ("triton earlier", old),
                           ("gluon earlier", NEW)):
            _dkdv_wgmma.eligible = rule
            _calls._CALLS.clear()
            configure()  # (a new configuration: the prepared calls plan anew)
            grads = measure(name, step, qkv, base)
            base = grads if base is None else base
        _dkdv_wgmma.eligible = NEW


if __name__ == "__main__":
    main()
