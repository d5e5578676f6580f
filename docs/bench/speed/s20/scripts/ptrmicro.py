"""Host µs of one relaunch of the decode kernel: tensors vs int pointers as pointer arguments."""
import time, torch
import hf_hilbert_attn
from hf_hilbert_attn.decode import plan_decode, run_decode
from hf_hilbert_attn.kernels import _launch
from hf_hilbert_attn.kernels._common import Strided
dev = "cuda"
hq, hkv, d, sk = 9, 3, 64, 1024
q = torch.randn(1, hq, 1, d, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, hkv, sk, d, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
pat = hf_hilbert_attn.patterns.as_pattern("default")
plan = plan_decode(pat, hq, hkv, sk, torch.arange(sk - 1, sk, device=dev), torch.arange(sk, device=dev))
run_decode(q, k, v, plan, 0.125); run_decode(q, k, v, plan, 0.125)
L = plan._made
out = torch.empty(1, 1, hq, d, device=dev, dtype=q.dtype).transpose(1, 2)
fn, grid, ints, tail, bound = L._state
args = (Strided(q, *q.stride()[:3]), Strided(k, *k.stride()[:3]), Strided(v, *v.stride()[:3]), Strided(out, *out.stride()[:3]), out, L.rule) + ints
def ptrs(x):
    if isinstance(x, torch.Tensor): return x.data_ptr()
    if isinstance(x, tuple): return tuple(ptrs(y) for y in x)
    return x
pargs = ptrs(args)
ker = bound[0]
def t(f, n=300):
    torch.cuda.synchronize(); f(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best
s = torch.cuda.current_stream().cuda_stream
ntens = sum(1 for x in torch.utils._pytree.tree_leaves(args) if isinstance(x, torch.Tensor))
res = dict(kernel_run_tensors=t(lambda: ker.run(*grid, 1, s, ker.function, ker.packed_metadata, None, None, None, *args, *bound[1])),
           kernel_run_ints=t(lambda: ker.run(*grid, 1, s, ker.function, ker.packed_metadata, None, None, None, *pargs, *bound[1])),
           convert_then_run=t(lambda: ker.run(*grid, 1, s, ker.function, ker.packed_metadata, None, None, None, *ptrs(args), *bound[1])),
           relaunch=t(lambda: _launch.relaunch(bound, grid, args)))
print(f"tensor args {ntens}: " + "  ".join(f"{k} {v:.2f}us" for k, v in res.items()), flush=True)
# check the int-pointer launch computes the same
o1 = out.clone(); ker.run(*grid, 1, s, ker.function, ker.packed_metadata, None, None, None, *pargs, *bound[1]); torch.cuda.synchronize()
print("same result:", torch.equal(o1, out))
