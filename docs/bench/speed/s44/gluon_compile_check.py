"""Compile the Gluon dk/dv launches (``kernels/_dkdv_wgmma.py``) of one forward+backward for sm_90
without a GPU: the backward planned as on an H100 (the kernel's eligibility without its device
test, every row taken as aligned), the launches recorded, each distinct Gluon specialization
compiled with ``ptxas -v`` (registers, spills, shared memory). Needs the device's Triton (3.6)
first on ``PYTHONPATH``:

    pip install --no-deps --target DIR triton==3.6.0
    PYTHONSAFEPATH=1 PYTHONPATH=DIR:$PWD python docs/bench/speed/s44/gluon_compile_check.py \
        4096 default longnet_lm
"""
import sys

import torch

import hf_hilbert_attn.kernels._bwd as bwd
import hf_hilbert_attn.kernels._dkdv_wgmma as wg
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools import aot

if wg.KERNEL is None:
    sys.exit("the Gluon dk/dv kernel needs Triton 3.6 (see the docstring)")
eligible = wg.eligible
wg.eligible = lambda fl, d, dt, dev, interp, over: eligible(fl, d, dt, torch.device("cuda"),
                                                            interp, over)
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # (the plan's H100 test)
bwd._quads = lambda ts: (tuple(t.stride() for t in ts),
                         tuple((t.data_ptr(), *t.stride()[:3]) for t in ts))
S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
for name in sys.argv[2:] or ["default"]:
    rows = lambda h: torch.empty(1, S, h, 128, dtype=torch.bfloat16).transpose(1, 2)  # noqa: E731
    calls = aot.launches(rows(32), rows(8), rows(8), as_pattern(name), arch=90)
    seen = set()
    for fn, grid, args, kwargs in calls:
        if fn is wg.KERNEL and (key := aot.spec_key(fn, args, kwargs, 90)) not in seen:
            seen.add(key)
            r = aot.compile_launch(fn, args, kwargs, arch=90)
            print(f"{name} S={S}: {r['variant']}: {r['registers']} registers, spills "
                  f"{r['spill_stores']} / {r['spill_loads']} bytes, shared {r['shared']} bytes",
                  flush=True)
    print(f"{name} S={S}: {sum(c[0] is wg.KERNEL for c in calls)} of {len(calls)} launches on the "
          "Gluon kernel", flush=True)
