"""Host time of the attention calls inside a training step on CPU, the kernels stubbed (no GPU
needed): each layer's attention function (forward and checkpoint recompute) and the eager
autograd Function's backward, per call. A random Llama with SmolLM2-135M's heads (9 / 3 x 64,
30 layers, a narrow hidden size so the CPU's matmuls stay short), S = 4096, default pattern,
one thread (OpenMP's spinning threads would slow the host code between ops).

OMP_NUM_THREADS=1 PYTHONPATH=<tree> python cpu_stub_insitu.py      (run from the repository)
"""
import os
import sys
import time
from collections import Counter, defaultdict

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "examples/benchmarks")
import torch  # noqa: E402
from host_overhead import _Launches  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

import hf_hilbert_attn.integrations.transformers as IT  # noqa: E402
import hf_hilbert_attn.ops as ops  # noqa: E402
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step  # noqa: E402

T, N = defaultdict(float), Counter()  # seconds and calls by name


def timed(name, fn):
    """``fn``, its calls' wall time added to ``T[name]``."""
    def f(*a, **k):
        t = time.perf_counter()
        r = fn(*a, **k)
        T[name] += time.perf_counter() - t
        N[name] += 1
        return r
    return f


def setup(seq=4096):
    """The model (the attention function and the Function's backward timed) and its tokens."""
    torch.set_num_threads(1)
    shape = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                 intermediate_size=64, num_hidden_layers=30, vocab_size=1000)
    m = build_model(shape, "hilbert_dilated", torch.float32, torch.device("cpu"),
                    pattern="default")
    AttentionInterface.register("hilbert_dilated",
                                timed("0 hf fwd", IT.hilbert_dilated_attention_forward))
    ops._EagerKernels.backward = staticmethod(timed("5 Function.backward",
                                                    ops._EagerKernels.backward))
    return m, torch.randint(0, 1000, (1, seq))


def steps(m, ids, n, warmup=2):
    """``n`` timed steps after ``warmup``, the kernels stubbed (taken for backend="auto")."""
    with _Launches(True, False):
        ops.use_triton = lambda *a: True
        for i in range(warmup + n):
            if i == warmup:
                T.clear(), N.clear()
            train_step(m, ids)
            m.zero_grad(set_to_none=True)


def report(n):
    for k in sorted(T):
        print(f"{k}: {T[k] * 1e6 / max(N[k], 1):.0f} µs x {N[k] / n:.0f}/step = "
              f"{T[k] * 1e3 / n:.2f} ms/step")


if __name__ == "__main__":
    model, tokens = setup()
    steps(model, tokens, 4)
    report(4)
