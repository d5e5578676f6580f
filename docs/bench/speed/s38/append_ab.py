"""Which PatternCache append decodes fastest where decoding is host-bound (4K, 128K): the layer's
append as a DynamicLayer concatenates ("cat"), this tree's (two narrow copies into kept room:
"room"), and a leaner one ("lean": the room recognised by weak references to the stored views,
both copies in one ``torch._foreach_copy_``). 1B, default pattern ± dense KV head 0, ms per
token, the methods stepped in turn (order rotated every round) in one process; then µs per
``update`` of one layer alone (8 KV heads x 64, bf16, 4096 stored tokens; host time: no sync in
the loop). The cuts (sparse pattern, every shift period) run this tree's ``_store`` in all three.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python docs/bench/speed/s38/append_ab.py CONTEXTS STEPS
"""
import statistics, sys, time, weakref
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
import hf_hilbert_attn
from hf_hilbert_attn import DilatedPattern, PatternCache, prefill
from hf_hilbert_attn.integrations import cache as C
from hf_hilbert_attn.tools.models import MODEL_SHAPES

contexts, steps = [int(x) for x in sys.argv[1].split(",")], int(sys.argv[2])
dev = torch.device("cuda")
room_append, room_store = C.PatternCacheLayer._append, C.PatternCacheLayer._store


def lean_store(self, parts):
    room_store(self, parts)
    if self._room is not None:
        self._room = (weakref.ref(self.keys), weakref.ref(self.values), self._room[1])


def lean_append(self, k, v):
    if not self.is_initialized:
        self.lazy_initialization(k, v)
    n, m, room = self.stored_tokens, k.shape[-2], self._room
    if C._plain(k, v) or room is None or n + m > room[2] or room[0]() is not self.keys or \
            room[1]() is not self.values or (self.keys.is_inference()
                                              and not torch.is_inference_mode_enabled()):
        self._store([(self.keys, k), (self.values, v)] if n else [(k,), (v,)])
    else:
        shape = (*k.shape[:-2], n + m, k.shape[-1])
        a, b = self.keys.as_strided(shape, self.keys.stride()), \
            self.values.as_strided(shape, self.values.stride())
        torch._foreach_copy_([a.narrow(-2, n, m), b.narrow(-2, n, m)], [k, v])
        self.keys, self.values, self._room = a, b, (weakref.ref(a), weakref.ref(b), room[2])
    return self.keys, self.values


VARIANTS = {"cat": (lambda self, k, v: DynamicLayer.update(self, k, v), room_store),
            "room": (room_append, room_store), "lean": (lean_append, lean_store)}


def mode(name):
    C.PatternCacheLayer._append, C.PatternCacheLayer._store = VARIANTS[name.split(":")[-1]] \
        if ":" in name else VARIANTS["room"]


def build(kv0: bool):
    cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    p = hf_hilbert_attn.patterns.as_pattern("default")
    return hf_hilbert_attn.configure(m, p.replace(dense_kv_heads=(0,)) if kv0 else p)


print(torch.cuda.get_device_name(), flush=True)
with torch.inference_mode():  # one layer's update alone, host µs
    x = torch.randn(1, 8, 1, 64, device=dev, dtype=torch.bfloat16)
    for name in ("cat", "room", "lean"):
        mode("x:" + name)
        best = 1e9
        for _ in range(5):
            layer = C.PatternCacheLayer(DilatedPattern.dense(1 << 20), 32)
            layer.update(torch.randn(1, 8, 4096, 64, device=dev, dtype=torch.bfloat16), x.repeat(1, 1, 4096, 1))
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(200):
                layer.update(x, x)
            best = min(best, (time.perf_counter() - t0) / 200)
            torch.cuda.synchronize()
        print(f"one layer's update, 4096 stored tokens, {name}: {best * 1e6:.1f} µs host", flush=True)
models = {False: build(False), True: build(True)}
for ctx in contexts:
    methods = ["dynamic+kv0"] + [f"pattern{h}:{v}" for h in ("+kv0", "") for v in VARIANTS]
    with torch.inference_mode():
        ids = torch.randint(3, 1000, (1, ctx), device=dev)
        state = {}
        for name in methods:
            m = models["kv0" in name]
            mode(name)
            cache = DynamicCache(config=m.config) if name.startswith("dynamic") else PatternCache(m)
            state[name] = [prefill(m, ids, chunk_tokens=16384, cache=cache), ids[:, -1:]]
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
            f"{n} {statistics.median(v):.2f} ({statistics.median([a / b for a, b in zip(v, base)]):.3f})"
            for n, v in times.items()), flush=True)
        del state; torch.cuda.empty_cache()
