"""The Gluon dk/dv kernel on launches with the per-pair union mask (MIXED, session 47) against
the Triton dk/dv kernel on those launches, in one process: per kernel GPU ms (profiler), fwd+bwd
ms (do_bench) and the gradients' largest difference ÷ largest gradient.

    python docs/bench/speed/s47/mixed.py 32/8/128:65536@longnet_lm 32/8/64:65536@longnet_lm

``triton`` runs the plan with the kernel's eligibility before (MIXED launches on the Triton
kernel), so only those launches change; the profiler names the Gluon kernel ``dkdv_wgmma``.
"""
import os
import sys

from hf_hilbert_attn.kernels import _dkdv_wgmma

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "s44"))
from tiles import compare_rules  # noqa: E402

NEW = _dkdv_wgmma.eligible

if __name__ == "__main__":
    compare_rules(sys.argv[1:], lambda flags, c: not flags.MIXED and NEW(flags, c), "mixed")
