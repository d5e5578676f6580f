"""Host µs per call of our attention's pieces inside a 135M training step (4K) and alone (the
same shape, calls back to back): the prepared call's forward / backward, our relaunches, and
Triton's launcher, each timed by a wrapper; the process's Python threads.

    python docs/bench/speed/s36/inside.py [S]
"""
import sys, threading, time, statistics
import torch
import hf_hilbert_attn.ops as ops
from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import _launch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dev = torch.device("cuda")
T = {}


def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            d = T.setdefault(name, [0, 0]); d[0] += time.perf_counter_ns() - t0; d[1] += 1
    return w


from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from hf_hilbert_attn.integrations.transformers import hilbert_dilated_attention_forward
ms = build_model(MODEL_SHAPES["135m"], "sdpa", torch.bfloat16, dev)
m = build_model(MODEL_SHAPES["135m"], "hilbert_dilated", torch.bfloat16, dev, pattern=as_pattern("default"))
ids = torch.randint(0, 49152, (1, S), device=dev)
for _ in range(3):
    train_step(m, ids); m.zero_grad(set_to_none=True)
AttentionInterface.register("hilbert_dilated", timed("ours: layer attention function",
                                                     hilbert_dilated_attention_forward))
AttentionInterface.register("sdpa", timed("sdpa: layer attention function", sdpa_attention_forward))
for _ in range(3):
    train_step(ms, ids); ms.zero_grad(set_to_none=True)
ops._Kernels.forward = timed("prepared forward", ops._Kernels.forward)
ops._Kernels.backward = timed("prepared backward", ops._Kernels.backward)
ops._EagerKernels.apply = timed("autograd apply (forward)", ops._EagerKernels.apply)
_launch.relaunch = timed("relaunch (ours + Triton launcher)", _launch.relaunch)
from hf_hilbert_attn.kernels import _bwd, _fwd
for mod, tag in ((_fwd, "fwd"), (_bwd, "bwd")):
    for name in ("relaunch_kept", "_quads", "_prep"):
        setattr(mod, name, timed(f"{tag} {name}", getattr(mod, name)))
for name in ("_sum_buffers", "_bwd_stats"):
    setattr(_bwd, name, timed(f"bwd {name}", getattr(_bwd, name)))
from triton.backends.nvidia import driver as nvd  # CompiledKernel.run: a CudaLauncher
nvd.CudaLauncher.__call__ = timed("Triton's CudaLauncher.__call__", nvd.CudaLauncher.__call__)


def report(title, calls_per):
    print(f"== {title}")
    for k, (ns, n) in sorted(T.items()):
        print(f"  {k:38s} {n / calls_per:6.1f} calls per {'step' if calls_per > 1 else 'unit'}  {ns / n / 1e3:8.1f} µs per call")


T.clear()
steps = 5
walls, swalls = [], []
for _ in range(steps):
    for model, w in ((m, walls), (ms, swalls)):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        train_step(model, ids); model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); w.append(time.perf_counter() - t0)
print(f"{torch.cuda.get_device_name()} S={S}: step {1e3 * statistics.median(walls):.1f} ms (sdpa {1e3 * statistics.median(swalls):.1f} ms); threads: "
      f"{[t.name for t in threading.enumerate()]}")
report(f"inside {steps} training steps", steps)
# alone: the model's attention shape, calls back to back
q = torch.randn(1, 9, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 3, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 3, S, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(1, 9, S, 64, device=dev, dtype=torch.bfloat16)
pat = as_pattern("default")
for _ in range(5):
    torch.autograd.grad(dilated_attention(q, k, v, pat), (q, k, v), g)
torch.cuda.synchronize()
T.clear()
for _ in range(5):
    outs = [dilated_attention(q, k, v, pat) for _ in range(20)]
    for o in outs:
        torch.autograd.grad(o, (q, k, v), g)
    torch.cuda.synchronize()
report("alone, 100 calls back to back", 1)
