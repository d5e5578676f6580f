"""Host µs per call of our attention's pieces inside training steps and alone, without a GPU:
a narrow 30-layer Llama (9 / 3 heads x 64, S tokens, gradient checkpointing) whose kernel
launches are stubbed (docs/bench/speed/s30/scripts/cpu_relaunch.py), each piece timed by a
wrapper. ``--meta``: every tensor on the meta device (no data: like a GPU host, the step's other
ops cost only their dispatch), else CPU tensors (the step's matmuls run on the CPU, evicting
its caches). ``--nogc`` / ``--freeze`` / ``--switch``: garbage collection off / frozen, a long
GIL switch interval.

    OMP_NUM_THREADS=1 python docs/bench/speed/s36/meta_inside.py [S] [--meta]
"""
import os, sys, time, statistics
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s30", "scripts"))
import torch
import cpu_relaunch as C
C.install()
import hf_hilbert_attn, hf_hilbert_attn.ops as ops
hf_hilbert_attn.ops.use_triton = lambda *a: True
from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import _launch, _bwd, _fwd
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import enable_checkpointing
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
T = {}
def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter_ns()
        try: return fn(*a, **k)
        finally:
            d = T.setdefault(name, [0, 0]); d[0] += time.perf_counter_ns() - t0; d[1] += 1
    return w
cfg = LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=64, num_hidden_layers=30, vocab_size=1000, max_position_embeddings=1 << 20)
torch.manual_seed(0)
DEV = "meta" if "--meta" in sys.argv else "cpu"
import transformers.masking_utils as mu
if DEV == "meta": mu.find_packed_sequence_indices = lambda *a, **k: None
m = hf_hilbert_attn.configure(LlamaForCausalLM(cfg).to(torch.bfloat16).to(DEV), "default")
enable_checkpointing(m); m.train()
ids = torch.randint(3, 1000, (1, S)).to(DEV)
def step():
    out = m.model(input_ids=ids, use_cache=False).last_hidden_state
    out.float().sum().backward(); m.zero_grad(set_to_none=True)
for _ in range(3): step()
ops._Kernels.forward = timed("prepared forward", ops._Kernels.forward)
ops._Kernels.backward = timed("prepared backward", ops._Kernels.backward)
for mod, tag in ((_fwd, "fwd"), (_bwd, "bwd")):
    for name in ("relaunch_kept", "_quads", "_prep", "kept_if_captured", "_fill_skipped"):
        setattr(mod, name, timed(f"{tag} {name}", getattr(mod, name)))
for name in ("_sum_buffers", "_bwd_stats", "_bwd_heads"):
    setattr(_bwd, name, timed(f"bwd {name}", getattr(_bwd, name)))
ops._EagerKernels.apply = timed("autograd apply (forward)", ops._EagerKernels.apply)
import hf_hilbert_attn.integrations.transformers as hi
hi._checked_pattern = timed("adapter _checked_pattern", hi._checked_pattern)
hi._layer_output = timed("adapter _layer_output", hi._layer_output)
from transformers import AttentionInterface
AttentionInterface.register("hilbert_dilated", timed("adapter total", hi.hilbert_dilated_attention_forward))
def report(title, per):
    print("==", title)
    for k, (ns, n) in sorted(T.items()):
        print(f"  {k:30s} {n/per:6.1f} calls  {ns/n/1e3:8.1f} us per call")
import gc
if "--nogc" in sys.argv: gc.disable()
if "--switch" in sys.argv: sys.setswitchinterval(1.0)
if "--freeze" in sys.argv: gc.freeze()
T.clear(); w = []
for _ in range(5):
    t0 = time.perf_counter(); step(); w.append(time.perf_counter() - t0)
import threading; print(f"step {1e3*statistics.median(w):.1f} ms", [t.name for t in threading.enumerate()], sys.getswitchinterval())
report("inside steps", 5)
q = torch.empty(1, 9, S, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
k = torch.empty(1, 3, S, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
v = torch.empty(1, 3, S, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
g = torch.ones(1, 9, S, 64, dtype=torch.bfloat16, device=DEV)
pat = as_pattern("default")
for _ in range(5): torch.autograd.grad(dilated_attention(q, k, v, pat, backend="triton"), (q, k, v), g)
T.clear()
for _ in range(5):
    outs = [dilated_attention(q, k, v, pat, backend="triton") for _ in range(20)]
    for o in outs: torch.autograd.grad(o, (q, k, v), g)
report("alone", 1)
