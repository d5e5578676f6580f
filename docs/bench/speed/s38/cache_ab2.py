"""s37's cache_ab.py with the methods' order rotated every round (s37's fixed order put the
in-place methods after the others in every round). PatternCache decoding with keys appended in
place (this tree: a step's two narrow copies; a cut writes the kept keys once, into a buffer
with room) against appended by concatenation (``DynamicLayer.update`` as the layer's append for
the "old" runs; their cuts as this tree's), beside a DynamicCache: 1B, default pattern ± dense
KV head 0, ms per token, methods stepped in turn in one process. Each method prefills its own cache. Past 256K a second full cache (~32 GiB at 1M)
would not fit beside two others on an 80 GiB card: there "pattern+kv0:old" is left out (a
PatternCache with dense heads keeps every key and appended as a DynamicCache does: the
DynamicCache row is that).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python docs/bench/speed/s38/cache_ab2.py CONTEXTS STEPS
"""
import statistics, sys, time
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
import hf_hilbert_attn
from hf_hilbert_attn import PatternCache, prefill
from hf_hilbert_attn.integrations.cache import PatternCacheLayer
from hf_hilbert_attn.tools.models import MODEL_SHAPES

contexts, steps = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2])
dev = torch.device("cuda")
new_append = PatternCacheLayer._append


def build(kv0: bool):
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    p = hf_hilbert_attn.patterns.as_pattern("default")
    return hf_hilbert_attn.configure(m, p.replace(dense_kv_heads=(0,)) if kv0 else p)


def mode(name):
    PatternCacheLayer._append = (lambda self, k, v: DynamicLayer.update(self, k, v)) \
        if name.endswith(":old") else new_append


models = {False: build(False), True: build(True)}
print(torch.cuda.get_device_name(), flush=True)
for ctx in contexts:
    methods = ["dynamic+kv0", "pattern+kv0:old", "pattern+kv0:new", "pattern:old", "pattern:new"]
    methods = methods if ctx <= 1 << 18 else [n for n in methods if n != "pattern+kv0:old"]
    with torch.inference_mode():
        ids = torch.randint(3, 1000, (1, ctx), device=dev)
        state = {}
        for name in methods:
            m = models["kv0" in name]
            mode(name)
            t0 = time.perf_counter()
            cache = DynamicCache(config=m.config) if name.startswith("dynamic") else PatternCache(m)
            state[name] = [prefill(m, ids, chunk_tokens=16384, cache=cache), ids[:, -1:]]
            torch.cuda.synchronize()
            print(f"prefill {ctx} {name}: {time.perf_counter() - t0:.1f} s, "
                  f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
        times = {n: [] for n in methods}
        for i in range(steps + 3):
            for name in methods[i % len(methods):] + methods[:i % len(methods)]:
                cache, tok = state[name]
                mode(name)
                torch.cuda.synchronize(); t0 = time.perf_counter()
                out = models["kv0" in name](input_ids=tok, past_key_values=cache, use_cache=True)
                state[name][1] = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i >= 3:
                    times[name].append(1e3 * (time.perf_counter() - t0))
        base = times["dynamic+kv0"]
        print(f"1b ctx={ctx} ms per token (÷ dynamic+kv0): " + "  ".join(
            f"{n} {statistics.median(v):.2f} ({statistics.median([a / b for a, b in zip(v, base)]):.2f})"
            for n, v in times.items()), flush=True)
        del state; torch.cuda.empty_cache()
