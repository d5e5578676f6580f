"""Host time of a model whose pattern is dense at its length (the default pattern up to 2K
tokens: the op's SDPA route), on the CPU: training steps and forwards of a narrow 30-layer Llama
(9 / 3 heads x 64) with the forward's later layers running the prepared SDPA call, beside every
layer checking and routing its own call (the previous behaviour), rounds interleaved.

    OMP_NUM_THREADS=1 python docs/bench/speed/s36/cpu_dense_route.py [S] [ROUNDS]
"""
import statistics, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_hilbert_attn
import hf_hilbert_attn.integrations.transformers as hf

torch.set_num_threads(1)
S = int(sys.argv[1]) if len(sys.argv) > 1 else 256
R = int(sys.argv[2]) if len(sys.argv) > 2 else 20
cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=64, num_hidden_layers=30, vocab_size=1000,
                  max_position_embeddings=1 << 16)
torch.manual_seed(0)
model = hf_hilbert_attn.configure(LlamaForCausalLM(cfg), "default")
assert hf.get_pattern(model.config).is_dense_for(S)
ids = torch.randint(3, 1000, (1, S))
real = hf.prepared


def train():
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def infer():
    with torch.inference_mode():
        model(input_ids=ids)


res = {}
for name, fn in (("train step", train), ("forward", infer)):
    for _ in range(3):
        fn()
    t = {"prepared SDPA call": [], "each layer checks": []}
    for r in range(R):
        for mode in (list(t) if r % 2 == 0 else list(t)[::-1]):
            hf.prepared = real if mode == "prepared SDPA call" else (lambda *a, **k: None)
            t0 = time.perf_counter(); fn(); t[mode].append(time.perf_counter() - t0)
    hf.prepared = real
    a, b = (statistics.median(v) * 1e3 for v in t.values())
    print(f"S={S} {name}: prepared SDPA call {a:.2f} ms, each layer checks {b:.2f} ms "
          f"({(b - a) * 1e3 / 30:.1f} µs per layer)", flush=True)
