"""The Gluon dk/dv kernel on launches with earlier configs (no per-pair union mask: not MIXED;
session 46) against the Triton dk/dv kernel on those launches, in one process: per kernel GPU
ms (profiler), fwd+bwd ms (do_bench) and the gradients' largest difference ÷ largest gradient.

    python docs/bench/speed/s46/earlier.py 32/8/128:65536@pow2 32/8/128:65536@longnet_lm

``triton`` runs the plan with the kernel's eligibility as before (no earlier config), so only
those launches change; the profiler names the Gluon kernel ``dkdv_wgmma``. (Since session 47
the loop is ``tiles.compare_rules``, shared with ``s47/mixed.py``. The library's eligibility now
takes MIXED launches too, and every MIXED launch has an earlier config, so on today's tree
``triton`` moves those to the Triton kernel as well; session 47's call 1 ran it before that.)
"""
import os
import sys

from hf_hilbert_attn.kernels import _dkdv_wgmma

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "s44"))
from tiles import compare_rules  # noqa: E402

NEW = _dkdv_wgmma.eligible

if __name__ == "__main__":
    compare_rules(sys.argv[1:], lambda flags, c: not flags.EARLIER and NEW(flags, c), "earlier")
