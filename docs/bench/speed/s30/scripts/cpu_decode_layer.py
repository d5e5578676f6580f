"""Host µs and Python calls of one decode layer call on the CPU with the decode kernel's fast
path (its launch stubbed: the launcher's guard and relaunch run as on a GPU after a step's first
layer; see cpu_relaunch.py): a random Llama (9 / 3 heads x 64, 4 layers, narrow) with ``CTX``
cached tokens, one decode step recorded, its second layer's call replayed.

OMP_NUM_THREADS=1 PYTHONPATH=<tree> python cpu_decode_layer.py [CTX] [--profile]
"""
import cProfile
import os
import pstats
import sys
import time

os.environ["HF_HILBERT_DECODE_KERNEL"] = "1"
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import cpu_relaunch as C  # noqa: E402
import hf_hilbert_attn  # noqa: E402
import hf_hilbert_attn.decode as decode  # noqa: E402
import hf_hilbert_attn.kernels._decode as kd  # noqa: E402
from hf_hilbert_attn.integrations import transformers as hi  # noqa: E402

C.install()
kd._decode_kernel = C._Jit(kd._decode_kernel)
decode._kernel = lambda q: True
real_call = kd.DecodeLauncher.__call__
kd.DecodeLauncher.__call__ = lambda self, *a, **k: real_call(self, *a, **{**k, "interpret": False})
torch.set_num_threads(1)
ctx = int(next((a for a in sys.argv[1:] if not a.startswith("--")), 4096))
cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=64, num_hidden_layers=4, vocab_size=1000,
                  max_position_embeddings=1 << 20)
torch.manual_seed(0)
model = hf_hilbert_attn.configure(LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), "default")
recorded = []


def recorder(module, q, k, v, mask, **kw):
    recorded.append((module, q, k, v, mask, kw))
    return hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)


with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, ctx))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    AttentionInterface.register("hilbert_dilated", recorder)
    model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    AttentionInterface.register("hilbert_dilated", hi.hilbert_dilated_attention_forward)
    module, q, k, v, mask, kw = recorded[1]
    call = lambda: hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)
    for _ in range(10):
        call()
    best = 1e9
    for _ in range(15):
        t0 = time.perf_counter()
        for _ in range(200):
            call()
        best = min(best, (time.perf_counter() - t0) / 200)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        call()
    pr.disable()
    st = pstats.Stats(pr)
    print(f"decode layer call, {ctx} keys: {best * 1e6:.1f} µs, "
          f"{st.total_calls / 100:.0f} Python-level calls")
    if "--profile" in sys.argv:
        st.sort_stats(sys.argv[-1] if sys.argv[-1] in ("cumtime", "tottime") else "tottime").print_stats(30)
