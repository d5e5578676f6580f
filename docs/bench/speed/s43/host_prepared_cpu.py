"""Host µs per call of a model layer's prepared attention call, forward and backward, on any
machine: the prepared call of ``dilated_attention`` (SmolLM2-135M heads, 9 / 3 x 64, bf16, S =
4096, the default pattern) with every Triton launch stubbed (``s30/scripts/cpu_relaunch.py``:
the relaunch path runs as on a GPU after the first call, nothing is launched). The best of 30
repeats of 50 calls. ``--meta``: tensors on the meta device.

    OMP_NUM_THREADS=1 python docs/bench/speed/s43/host_prepared_cpu.py [--meta]
"""
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s30", "scripts"))
import torch  # noqa: E402

import cpu_relaunch as C  # noqa: E402

C.install()
import hf_hilbert_attn.ops as _ops  # noqa: E402

_ops.use_triton = lambda *a: True  # (CPU tensors take the stubbed kernels)
from hf_hilbert_attn import dilated_attention  # noqa: E402
from hf_hilbert_attn.ops import prepared  # noqa: E402
from hf_hilbert_attn.patterns import as_pattern  # noqa: E402

torch.set_num_threads(1)
S = 4096
pat = as_pattern("default")
dev = "meta" if "--meta" in sys.argv else "cpu"
mk = lambda h: torch.empty(1, S, h, 64, dtype=torch.bfloat16, device=dev).transpose(1, 2).requires_grad_()  # noqa: E731,E501 (a layer's q/k/v: [B, S, H, D] storage)
q, k, v = mk(9), mk(3), mk(3)
g = torch.ones(1, 9, S, 64, dtype=torch.bfloat16, device=dev)
dilated_attention(q, k, v, pat)
p = prepared(q, k, v, pat)
assert p is not None, "no prepared call"


def fwd():
    return p(q, k, v)


def bwd(o):
    return torch.autograd.grad(o, (q, k, v), g)


best_f, best_b = C.best_per_call(fwd, bwd, warmup=50, repeats=30, calls=50)
print(f"prepared call ({dev}, launches stubbed): forward {1e6 * best_f:.1f} µs, backward "
      f"{1e6 * best_b:.1f} µs (the best of 30 repeats of 50 calls)")
