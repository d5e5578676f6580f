"""Host µs of one PatternCacheLayer update (one new token, 8 KV heads x 64, bf16), appended into
kept room (this tree) against by concatenation (the layer's previous update, restored here), on
this CPU: a cache of N0 tokens growing by STEPS tokens, the best of 5 runs. Without a GPU the
concatenation's copy is memory work of this CPU too; at 64 tokens it is mostly host work.

    OMP_NUM_THREADS=1 python docs/bench/speed/s37/cpu_cache_append.py
"""
import time
import torch
from transformers.cache_utils import DynamicLayer
from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn.integrations.cache import PatternCacheLayer

torch.set_num_threads(1)
pattern = DilatedPattern.dense(1 << 20)  # (drops nothing: every update is an append)


def per_update(mode: str, n0: int, steps: int) -> float:
    layer = PatternCacheLayer(pattern, 32)
    if mode == "concatenated":
        layer._append = lambda k, v: DynamicLayer.update(layer, k, v)
    k = torch.randn(1, 8, n0, 64).to(torch.bfloat16)
    x = torch.randn(1, 8, 1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        layer.update(k, k.clone())
        t0 = time.perf_counter()
        for _ in range(steps):
            layer.update(x, x)
        return (time.perf_counter() - t0) / steps * 1e6


for n0, steps in ((64, 300), (4096, 300), (65536, 100)):
    r = {m: min(per_update(m, n0, steps) for _ in range(5)) for m in ("concatenated", "in room")}
    print(f"{n0} tokens (+{steps}): µs per update, concatenated {r['concatenated']:.1f}, "
          f"into kept room {r['in room']:.1f}", flush=True)
