"""Host µs of our attention in a decode step, without a GPU: a narrow 16-layer Llama (8 / 2
heads x 64, bf16, 512 tokens of context, a DynamicCache) steps one token at a time with the
decode kernel's launch stubbed (``s30/scripts/cpu_relaunch.py``; the launcher's relaunch path
runs as on a GPU). Printed: ms a step beside the same model with an attention that returns
zeros (the model's own host time), three rounds, then µs a call of each piece of our layer
call (a timing wrapper each: ~0.3 µs of it is the wrapper's).

    OMP_NUM_THREADS=1 python docs/bench/speed/s43/decode_host_cpu.py
"""
import os
import statistics
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s30", "scripts"))
import torch  # noqa: E402

import cpu_relaunch as C  # noqa: E402

C.install()
import hf_hilbert_attn  # noqa: E402
import hf_hilbert_attn.decode as D  # noqa: E402
import hf_hilbert_attn.integrations.transformers as hi  # noqa: E402
from hf_hilbert_attn.kernels import _decode as KD  # noqa: E402
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

KD._decode_kernel = C._Jit(KD._decode_kernel)
D._kernel = lambda q: True  # (CPU tensors take the stubbed decode kernel)
_launcher_call = KD.DecodeLauncher.__call__
KD.DecodeLauncher.__call__ = lambda self, *a, interpret=False, **k: _launcher_call(
    self, *a, interpret=False, **k)  # (as on a GPU: the relaunch path)
AttentionInterface.register("zeros", lambda module, q, k, v, mask, **kw: (
    q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None))
torch.set_num_threads(1)
cfg = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  intermediate_size=64, num_hidden_layers=16, vocab_size=256,
                  max_position_embeddings=1 << 16)


def build(impl):
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    if impl == "zeros":
        m.set_attn_implementation("zeros")
        return m
    return hf_hilbert_attn.configure(m, "default")


def steps(m, n):
    """Median seconds a decode step over ``n`` steps after 10, from 512 tokens of context."""
    with torch.inference_mode():
        cache = DynamicCache(config=m.config)
        tok = m(input_ids=torch.randint(3, 256, (1, 512)), past_key_values=cache,
                use_cache=True).logits[:, -1:].argmax(-1)
        ts = []
        for _ in range(n + 10):
            t0 = time.perf_counter()
            tok = m(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[10:])


models = {impl: build(impl) for impl in ("zeros", "ours")}
for r in range(3):
    line = {impl: f"{1e3 * steps(m, 50):.2f} ms" for impl, m in models.items()}
    print(f"round {r}: a step (16 layers) with zeros for attention {line['zeros']}, ours {line['ours']}")
T = {}  # piece -> [nanoseconds, calls]


class Timed:
    """``fn`` with each call's time added to ``T[name]``."""

    def __init__(self, name, fn):
        self.name, self.fn, T[name] = name, fn, [0, 0]

    def __call__(self, *args, **kwargs):
        start = time.perf_counter_ns()
        out = self.fn(*args, **kwargs)
        T[self.name][0] += time.perf_counter_ns() - start
        T[self.name][1] += 1
        return out


for name in ("autocast_inputs", "_layer_sizes", "_checked_pattern", "_layer_output"):
    setattr(hi, name, Timed(name, getattr(hi, name)))
for name in ("__call__", "fits"):  # (methods: a function around the instance, to bind self)
    timed = Timed(f"PreparedDecode.{name}", getattr(D.PreparedDecode, name))
    setattr(D.PreparedDecode, name, lambda self, *a, _t=timed, **k: _t(self, *a, **k))
steps(models["ours"], 5)
for v in T.values():
    v[:] = [0, 0]
steps(models["ours"], 50)
for name, (ns, n) in sorted(T.items(), key=lambda kv: -kv[1][0]):
    print(f"  {name:26s} {ns / n / 1e3:6.2f} µs a call")
