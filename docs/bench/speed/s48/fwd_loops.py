"""The forward's key loops compiled for sm_90 without a GPU: SASS instructions per loop of our
library's forward launches and of the plain probe (``fwd_probe.py``, pointer loads, 128 x 64), and
the opcodes where the dense launch's full-tile loop and the probe's differ. Needs the device's
Triton (3.6) first on ``PYTHONPATH``:

    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s48/fwd_loops.py \
        dense default longnet_lm
"""
import collections
import os
import re
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "s44")]
import fwd_probe  # noqa: E402
from gluon_compile_check import sass_loop_bodies as loops  # noqa: E402
from hf_hilbert_attn import DilatedPattern  # noqa: E402
from hf_hilbert_attn.patterns import as_pattern  # noqa: E402
from hf_hilbert_attn.tools import aot  # noqa: E402


def opcodes(body) -> collections.Counter:
    out = collections.Counter()
    for line in body:
        text = re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[-1].strip())
        out[text.split()[0].split(".")[0]] += 1
    return out


def main(names):
    D, S = 128, 4096
    q = torch.empty(1, 4, S, D, dtype=torch.bfloat16)
    k = torch.empty(1, 1, S, D, dtype=torch.bfloat16)
    grid, args, kw = fwd_probe.launch_args(q, k, k, q, dict(TMA=0, WS=0, BN=64))
    row, kern = aot._compile(fwd_probe._probe_fwd, args, kw, 90, True)
    probe = list(loops(kern.asm["cubin"]))
    print(f"probe 128x64: registers {row['registers']}, loops {[len(b) for b in probe]}")
    for name in names:
        pattern = DilatedPattern.dense(S) if name == "dense" else as_pattern(name)
        for fn, grid, args, kwargs in aot.launches(q, k, k, pattern, backward=False):
            row, kern = aot._compile(fn, args, kwargs, 90, True)
            ours = list(loops(kern.asm["cubin"]))
            print(f"{name} {row['variant'][:24]} EARLIER={kwargs['F'].EARLIER}: registers "
                  f"{row['registers']}, spills {row['spill_stores']}/{row['spill_loads']}, "
                  f"loops {[len(b) for b in ours]}")
            if name == "dense":
                a, b = opcodes(probe[0]), opcodes(ours[0])
                print("  full-tile loop, opcodes that differ (probe / ours): " + ", ".join(
                    f"{op} {a[op]}/{b[op]}" for op in sorted(set(a) | set(b),
                                                             key=lambda o: a[o] - b[o])
                    if a[op] != b[op]))


if __name__ == "__main__":
    main(sys.argv[1:] or ["dense"])
