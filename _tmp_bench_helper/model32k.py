import time, resource, sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
import hf_hilbert_attn
S = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16, vocab_size=256, max_position_embeddings=S)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hilbert_dilated")
hf_hilbert_attn.configure(model, "configs/longnet_lm.yaml")
model.eval()
ids = torch.randint(0, 256, (1, S))
with torch.no_grad():
    t = time.time(); c = time.process_time()
    loss = model(ids, labels=ids).loss
    print(f"S={S} forward wall {time.time()-t:.1f} s cpu {time.process_time()-c:.1f} s loss {loss.item():.3f}")
print("peak RSS MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
