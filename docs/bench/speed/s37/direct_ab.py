"""The C-launcher path of a relaunch (``kernels/_launch._c_launch``) on and off in one process,
round by round beside SDPA: a 135M training step at S tokens and 1B decoding after CTX tokens of
context (DynamicCache, ± dense KV head 0). "off": every relaunch through Triton's launcher object.

    python docs/bench/speed/s37/direct_ab.py [S] [CTX] [ROUNDS]
"""
import statistics, sys, time
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import hf_hilbert_attn
from hf_hilbert_attn import prefill
from hf_hilbert_attn.kernels import _launch
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

S = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
R = int(sys.argv[3]) if len(sys.argv) > 3 else 10
dev = torch.device("cuda")
real, on_c, off_c = _launch._c_launch, _launch._C, {}


def mode(on: bool):  # (each its own memo, kept: the C path's first look per kernel is made once)
    _launch._C, _launch._c_launch = (on_c, real) if on else (off_c, lambda kernel: ())


def rounds(steps: dict, n: int, warm=3):
    """{name: step()}, with names ending in ':off' run with the C path off; ms per step."""
    t = {k: [] for k in steps}
    for i in range(n + warm):
        for k, f in steps.items():
            mode(not k.endswith(":off"))
            torch.cuda.synchronize(); t0 = time.perf_counter(); f()
            torch.cuda.synchronize()
            if i >= warm:
                t[k].append(1e3 * (time.perf_counter() - t0))
    return t


def show(title, t, base):
    print(f"{title}: " + "  ".join(
        f"{k} {statistics.median(v):.2f} ms (÷{base} {statistics.median([a / b for a, b in zip(v, t[base])]):.3f})"
        for k, v in t.items()), flush=True)


print(torch.cuda.get_device_name(), flush=True)
pat = as_pattern("default")
# alone: host µs to issue 20 forward calls (the 135M layer's shape, S tokens, no autograd), then
# a sync outside the timing; blocks with the C path on and off alternate
from hf_hilbert_attn import dilated_attention
q = torch.randn(1, 9, S, 64, device=dev, dtype=torch.bfloat16)
k, v = (torch.randn(1, 3, S, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
alone = {True: [], False: []}
with torch.no_grad():
    for i in range(2 * 30 + 4):
        on = bool(i % 2)
        mode(on)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(20):
            dilated_attention(q, k, v, pat)
        t1 = time.perf_counter(); torch.cuda.synchronize()
        if i >= 4:
            alone[on].append(1e6 * (t1 - t0) / 20)
print(f"alone, forward S={S}: host µs a call, C path off {statistics.median(alone[False]):.1f}, "
      f"on {statistics.median(alone[True]):.1f} (launches a call: 2 at 4K)", flush=True)
ids = torch.randint(0, 49152, (1, S), device=dev)
ms = {n: build_model(MODEL_SHAPES["135m"], impl, torch.bfloat16, dev, pattern=p)
      for n, impl, p in (("sdpa", "sdpa", None), ("default", "hilbert_dilated", pat))}


def train(m):
    def f():
        train_step(m, ids); m.zero_grad(set_to_none=True)
    return f


t = rounds({"sdpa": train(ms["sdpa"]), "default:off": train(ms["default"]),
            "default": train(ms["default"])}, R)
show(f"135m train S={S}, ms per step", {k: v for k, v in t.items()}, "sdpa")
print("C launches kept:", sum(1 for k, v in on_c.items() if not isinstance(k, type) and v),
      "of", sum(1 for k in on_c if not isinstance(k, type)), flush=True)
del ms; torch.cuda.empty_cache()

cfg = LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES["1b"])
models = {}
for n in ("sdpa", "default", "default+kv0"):
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(cfg)
    m.to(torch.bfloat16).eval()
    if n == "sdpa":
        m.set_attn_implementation("sdpa")
    else:
        hf_hilbert_attn.configure(m, pat.replace(dense_kv_heads=(0,)) if "kv0" in n else pat)
    models[n] = m
with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, CTX), device=dev)
    state = {n: [prefill(m, ids, chunk_tokens=16384, cache=DynamicCache(config=m.config)),
                 ids[:, -1:]] for n, m in models.items()}

    def dec(n):
        def f():
            cache, tok = state[n]
            with (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if n == "sdpa" else torch.autocast("cuda", enabled=False)):
                out = models[n](input_ids=tok, past_key_values=cache, use_cache=True)
            state[n][1] = out.logits[:, -1:].argmax(-1)
        return f
    steps = {"sdpa-flash": dec("sdpa")}
    for n in ("default", "default+kv0"):
        steps[n + ":off"] = dec(n)
        steps[n] = dec(n)
    t = rounds(steps, 2 * R)
    show(f"1b decode ctx={CTX}, ms per token", t, "sdpa-flash")
