"""The time of gradient checkpointing's pack hook per saved tensor in short training steps, ours
against SDPA (a cProfile of a 4K step put 44 ms a step more in it for ours): each call of the
forward's pack hook timed, summed by the saved tensor's shape and dtype, unprofiled.

    python docs/bench/speed/s43/pack_hook.py [S] [STEPS]
"""
import sys, time
from collections import defaultdict
import torch
import torch.utils.checkpoint as ckpt
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
N = int(sys.argv[2]) if len(sys.argv) > 2 else 5
T = defaultdict(lambda: [0, 0.0, 0.0])  # key -> calls, seconds, max
_orig = ckpt._checkpoint_hook.__init__


def init(self, frame):
    _orig(self, frame)
    pack = self.pack_hook

    def timed(x):
        t0 = time.perf_counter()
        try:
            return pack(x)
        finally:
            d = time.perf_counter() - t0
            e = T[(tuple(x.shape), str(x.dtype).replace("torch.", ""), x.requires_grad)]
            e[0] += 1; e[1] += d; e[2] = max(e[2], d)
    self.pack_hook = timed


ckpt._checkpoint_hook.__init__ = init
dev = torch.device("cuda")
shape = MODEL_SHAPES["135m"]
for m, impl, p in (("sdpa", "sdpa", None), ("default", "hilbert_dilated", as_pattern("default"))):
    model = build_model(shape, impl, torch.bfloat16, dev, pattern=p)
    ids = torch.randint(0, shape["vocab_size"], (1, S), device=dev)
    for _ in range(3):
        train_step(model, ids); model.zero_grad(set_to_none=True)
    T.clear()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(N):
        train_step(model, ids); model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / N
    tot = sum(v[1] for v in T.values()) / N
    print(f"== {m}: {1e3 * step:.1f} ms a step, pack hook {1e3 * tot:.2f} ms a step "
          f"({sum(v[0] for v in T.values()) / N:.0f} calls)")
    for k, (n, s, mx) in sorted(T.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {str(k):45s} {n / N:6.0f} calls {1e6 * s / n:8.1f} us avg {1e6 * mx:9.1f} us max")
    del model
