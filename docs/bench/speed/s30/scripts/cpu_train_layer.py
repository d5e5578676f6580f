"""Host µs and Python calls of one training layer call (forward with autograd, and its
backward) on the CPU with the kernels' fast path (launches stubbed, as cpu_relaunch.py): a
random Llama (9 / 3 heads x 64, 4 layers, narrow), S tokens, one forward recorded, its second
layer's attention call replayed.

OMP_NUM_THREADS=1 PYTHONPATH=<tree> python cpu_train_layer.py [S] [--profile] [cumtime]
"""
import cProfile
import os
import pstats
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402

import cpu_relaunch as C  # noqa: E402
import hf_hilbert_attn  # noqa: E402
import hf_hilbert_attn.ops  # noqa: E402
from hf_hilbert_attn.integrations import transformers as hi  # noqa: E402

C.install()
hf_hilbert_attn.ops.use_triton = lambda *a: True  # (the model's calls ask for "auto")
torch.set_num_threads(1)
seq = int(next((a for a in sys.argv[1:] if a.isdigit()), 4096))
cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=64, num_hidden_layers=4, vocab_size=1000,
                  max_position_embeddings=1 << 20)
torch.manual_seed(0)
model = hf_hilbert_attn.configure(LlamaForCausalLM(cfg).to(torch.bfloat16), "default")
recorded = []


def recorder(module, q, k, v, mask, **kw):
    recorded.append((module, q.detach().requires_grad_(), k.detach().requires_grad_(),
                     v.detach().requires_grad_(), mask, kw))
    return hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)


ids = torch.randint(3, 1000, (1, seq))
model(input_ids=ids)
AttentionInterface.register("hilbert_dilated", recorder)
model(input_ids=ids)
AttentionInterface.register("hilbert_dilated", hi.hilbert_dilated_attention_forward)
module, q, k, v, mask, kw = recorded[1]
fwd = lambda: hi.hilbert_dilated_attention_forward(module, q, k, v, mask, **kw)[0]
g = torch.ones(1, seq, 9, 64, dtype=torch.bfloat16)
bwd = lambda o: torch.autograd.grad(o, (q, k, v), g)
bf, bb = C.best_per_call(fwd, bwd)
res = {}
for name, fn in (("forward", fwd), ("backward", lambda: bwd(fwd()))):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        fn()
    pr.disable()
    res[name] = pstats.Stats(pr)
n_f = res["forward"].total_calls / 100
print(f"training layer call, S={seq}: forward {bf * 1e6:.1f} µs ({n_f:.0f} Python-level calls), "
      f"backward {bb * 1e6:.1f} µs ({res['backward'].total_calls / 100 - n_f:.0f})")
if "--profile" in sys.argv:
    for name, st in res.items():
        print("==", name)
        st.sort_stats(sys.argv[-1] if sys.argv[-1] in ("cumtime", "tottime") else "tottime")
        st.print_stats(25)
