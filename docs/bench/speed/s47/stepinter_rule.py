"""stepinter.py (session 20) with the dk/dv launches with earlier configs on the Triton kernel
(OLD_RULE=1: session 46's eligibility) or as the tree has them: an A/B of the Gluon kernel on
those launches inside a training step.

    OLD_RULE=1 python docs/bench/speed/s47/stepinter_rule.py 135m 4096,16384 8 old
"""
import os
import runpy
import sys

from hf_hilbert_attn.kernels import _dkdv_wgmma

if os.environ.get("OLD_RULE"):
    new = _dkdv_wgmma.eligible
    _dkdv_wgmma.eligible = lambda flags, c: not flags.EARLIER and new(flags, c)
here = os.path.dirname(os.path.abspath(__file__))
sys.argv = [sys.argv[0]] + sys.argv[1:]
runpy.run_path(os.path.join(here, "..", "s20", "scripts", "stepinter.py"), run_name="__main__")
