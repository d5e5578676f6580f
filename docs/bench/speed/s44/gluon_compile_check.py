"""Compile the Gluon dk/dv launches (``kernels/_dkdv_wgmma.py``) of one forward+backward for sm_90
without a GPU: the backward planned as on an H100 (the kernel's eligibility without its device
test, every row taken as aligned), the launches recorded, each distinct Gluon specialization
compiled with ``ptxas -v`` (registers, spills, shared memory). Needs the device's Triton (3.6)
first on ``PYTHONPATH``:

    pip install --no-deps --target DIR triton==3.6.0
    PYTHONSAFEPATH=1 PYTHONPATH=DIR:$PWD python docs/bench/speed/s44/gluon_compile_check.py \
        --seq 4096 default longnet_lm

``--bm 64``: 64 queries a step; ``--dim 64``: head size 64 (9 / 3 heads); ``--loops``: the
SASS loops holding MMAs, their instruction counts and spill loads / stores (``nvdisasm`` from
the Triton wheel).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

import hf_hilbert_attn.kernels._bwd as bwd
import hf_hilbert_attn.kernels._dkdv_wgmma as wg
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools import aot


def sass_loop_bodies(cubin: bytes):
    """The SASS lines of each loop holding an MMA (a back branch to an earlier label)."""
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


def sass_loops(cubin: bytes):
    """``(instructions, MMAs, spill stores, spill loads)`` of each loop with an MMA."""
    for body in sass_loop_bodies(cubin):
        yield (len(body), sum("HGMMA" in b for b in body), sum("STL" in b for b in body),
               sum("LDL" in b for b in body))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("patterns", nargs="*", default=["default"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--bm", type=int, default=wg.BM)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--loops", action="store_true")
    args = ap.parse_args()
    if wg.KERNEL is None:
        sys.exit("the Gluon dk/dv kernel needs Triton 3.6 (see the docstring)")
    wg.BM, eligible = args.bm, wg.eligible
    wg.eligible = lambda fl, c: eligible(fl, c._replace(device=torch.device("cuda")))
    torch.cuda.get_device_capability = lambda device=None: (9, 0)  # (the plan's H100 test)
    bwd._quads = lambda ts: (tuple(t.stride() for t in ts),
                             tuple((t.data_ptr(), *t.stride()[:3]) for t in ts))
    hq, hkv = (32, 8) if args.dim == 128 else (9, 3)
    for name in args.patterns:
        rows = lambda h: torch.empty(1, args.seq, h, args.dim,  # noqa: E731
                                     dtype=torch.bfloat16).transpose(1, 2)
        calls = aot.launches(rows(hq), rows(hkv), rows(hkv), as_pattern(name), arch=90)
        seen = set()
        for fn, grid, a, kw in calls:
            if fn is wg.KERNEL and (key := aot.spec_key(fn, a, kw, 90)) not in seen:
                seen.add(key)
                r, kernel = aot._compile(fn, a, kw, 90, True)
                print(f"{name} S={args.seq}: {r['variant']}: {r['registers']} registers, spills "
                      f"{r['spill_stores']} / {r['spill_loads']} bytes, shared {r['shared']} bytes",
                      flush=True)
                for n, mma, stl, ldl in sass_loops(kernel.asm["cubin"]) if args.loops else ():
                    print(f"  loop: {n} instructions, {mma} MMAs, {stl} spill stores, {ldl} "
                          "spill loads")
        print(f"{name} S={args.seq}: {sum(c[0] is wg.KERNEL for c in calls)} of {len(calls)} "
              "launches on the Gluon kernel", flush=True)


if __name__ == "__main__":
    main()
