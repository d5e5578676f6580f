"""Host time of the attention calls inside a real training step: each layer's attention
function (Transformers' `AttentionInterface` entry, forward and checkpoint recompute) and its
backward node (between the autograd node's pre-hook and hook), for SDPA and ours, per step.

python step_insitu.py [SHAPE] [SEQ] [STEPS] [ROUNDS]     (135m 4096 8 2; bf16, B = 1)
"""
import sys
import time
from collections import Counter, defaultdict

import torch
from transformers.modeling_utils import AttentionInterface

import hf_hilbert_attn  # noqa: F401 (registers hilbert_dilated)
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES

T, N = defaultdict(float), Counter()  # seconds and calls by tag (read by s31's step_autocast)
NODES = ("ScaledDotProduct", "EagerKernels", "DilatedAttention", "dilated")


def _node(fn, depth=4):
    """The attention's autograd node under ``fn`` (breadth first, a few levels)."""
    level = [fn]
    for _ in range(depth):
        nxt = []
        for f in level:
            if f is None:
                continue
            if any(n in type(f).__name__ or n in f.name() for n in NODES):
                return f
            nxt += [g for g, _ in f.next_functions]
        level = nxt
    return None


def timed(tag, fn):
    def call(module, query, key, value, attention_mask, **kwargs):
        t0 = time.perf_counter()
        out = fn(module, query, key, value, attention_mask, **kwargs)
        T[tag + " fwd"] += time.perf_counter() - t0
        N[tag + " fwd"] += 1
        node = _node(out[0].grad_fn) if out[0].requires_grad else None
        if node is not None:
            start = []
            node.register_prehook(lambda g: start.append(time.perf_counter()))

            def done(gi, go):
                T[tag + " bwd"] += time.perf_counter() - start.pop()
                N[tag + " bwd"] += 1
            node.register_hook(done)
        return out
    return call


if __name__ == "__main__":
    shape = sys.argv[1] if len(sys.argv) > 1 else "135m"
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pat = as_pattern("default")
    methods = {"sdpa": ("sdpa", None), "default": ("hilbert_dilated", pat),
               "default+kv0": ("hilbert_dilated", pat.replace(dense_kv_heads=(0,)))}
    models = {m: build_model(MODEL_SHAPES[shape], impl, torch.bfloat16, dev, pattern=p)
              for m, (impl, p) in methods.items()}
    for impl in ("sdpa", "hilbert_dilated"):
        AttentionInterface.register(impl, timed(impl, AttentionInterface._global_mapping[impl]))
    ids = torch.randint(0, MODEL_SHAPES[shape]["vocab_size"], (1, S), device=dev)
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{card}, {shape} at {S}, bf16; host ms per step in the attention "
          f"calls (calls per step), {STEPS} steps a round")
    for r in range(ROUNDS):
        for name, model in models.items():
            for _ in range(2 if r == 0 else 1):
                train_step(model, ids)
                model.zero_grad(set_to_none=True)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            T.clear(), N.clear()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                train_step(model, ids)
                model.zero_grad(set_to_none=True)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            wall = (time.perf_counter() - t0) / STEPS * 1e3
            parts = "  ".join(f"{k} {T[k] * 1e3 / STEPS:.2f} ms ({N[k] // STEPS}, "
                              f"{T[k] * 1e6 / max(N[k], 1):.0f} µs each)" for k in sorted(T))
            print(f"round {r} {name}: step {wall:.1f} ms  {parts}", flush=True)
