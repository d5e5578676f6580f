"""Host µs per attention-layer call in decode steps (no sync inside), sdpa-flash vs ours; GPU µs per attention kernel."""
import sys, time, statistics, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
import hf_hilbert_attn
from hf_hilbert_attn.integrations import transformers as integ
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from transformers import LlamaConfig, LlamaForCausalLM, DynamicCache, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from torch.profiler import profile, ProfilerActivity
shape, ctx = sys.argv[1], int(sys.argv[2])
dev = torch.device("cuda")
times = {}
def wrap(name, fn):
    def f(*a, **k):
        t = time.perf_counter_ns(); out = fn(*a, **k); times.setdefault(name, []).append(time.perf_counter_ns() - t); return out
    return f
AttentionInterface.register("t_sdpa", wrap("sdpa", sdpa_attention_forward))
AttentionInterface.register("hilbert_dilated", wrap("ours", integ.hilbert_dilated_attention_forward))
cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape])
torch.manual_seed(0)
with dev:
    model = LlamaForCausalLM(cfg)
model.to(torch.bfloat16).eval()
hf_hilbert_attn.configure(model, "default")
AttentionInterface.register("hilbert_dilated", wrap("ours", integ.hilbert_dilated_attention_forward))
ids = torch.randint(3, 1000, (1, ctx), device=dev)
for impl, name in (("t_sdpa", "sdpa"), ("hilbert_dilated", "ours"), ("t_sdpa", "sdpa"), ("hilbert_dilated", "ours")):
    model.set_attn_implementation(impl)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        tok = ids[:, -1:]
        times.clear()
        for i in range(20):
            out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        v = sorted(times[name])
        print(f"{shape} ctx={ctx} {name}: host per layer call median {v[len(v)//2]/1e3:.1f} us p10 {v[len(v)//10]/1e3:.1f} us", flush=True)
        if len(sys.argv) > 3:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(5):
                    out = model(tok, past_key_values=cache, use_cache=True); tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if "decode" in e.key or "flash" in e.key.lower() or "fmha" in e.key.lower():
                    print(f"   kernel {e.key[:70]} {e.device_time_total/e.count:.1f} us x{e.count}")
