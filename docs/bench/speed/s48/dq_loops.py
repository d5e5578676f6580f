"""The dq launches' key loops compiled for sm_90 on the CPU (as ``fwd_loops.py``): registers,
spills and, per loop, (SASS instructions, spill stores, spill loads). Needs the device's Triton
(3.6) first on ``PYTHONPATH``:

    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s48/dq_loops.py \
        default [HEAD_SIZE]
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "s44"))
from gluon_compile_check import sass_loop_bodies  # noqa: E402
from hf_hilbert_attn import DilatedPattern  # noqa: E402
from hf_hilbert_attn.patterns import as_pattern  # noqa: E402
from hf_hilbert_attn.tools import aot  # noqa: E402


def main(name: str, d: int = 128, s: int = 4096):
    q = torch.empty(1, 4, s, d, dtype=torch.bfloat16)
    k = torch.empty(1, 1, s, d, dtype=torch.bfloat16)
    pattern = DilatedPattern.dense(s) if name == "dense" else as_pattern(name)
    for fn, grid, args, kwargs in aot.launches(q, k, k, pattern, backward=True):
        if fn.__name__ != "_dq_kernel":
            continue
        row, kern = aot._compile(fn, args, kwargs, 90, True)
        loops = [(len(b), sum("STL" in x for x in b), sum("LDL" in x for x in b))
                 for b in sass_loop_bodies(kern.asm["cubin"])]
        print(name, d, row["variant"][:22], "EARLIER", kwargs["F"].EARLIER, "regs",
              row["registers"], "spills", row["spill_stores"], row["spill_loads"], "loops", loops)


if __name__ == "__main__":
    main(sys.argv[1], *(int(x) for x in sys.argv[2:3]))
