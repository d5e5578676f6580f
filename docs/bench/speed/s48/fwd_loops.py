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
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fwd_probe  # noqa: E402
from hf_hilbert_attn import DilatedPattern  # noqa: E402
from hf_hilbert_attn.patterns import as_pattern  # noqa: E402
from hf_hilbert_attn.tools import aot  # noqa: E402


def loops(cubin: bytes):
    """The SASS lines of each loop holding an MMA (back branch to an earlier label)."""
    nvdisasm = os.path.join(os.path.dirname(aot.ptxas_path(90)), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([nvdisasm, "-c", f.name], capture_output=True,
                               text=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [b for b in lines[labels[m.group(1)]:i] if "/*" in b and ";" in b]
            if any("HGMMA" in b for b in body):
                yield body


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
