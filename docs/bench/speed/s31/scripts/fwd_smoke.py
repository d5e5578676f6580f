"""The one-launch forward on a GPU, quickly: out and lse of every shipped pattern (and one
with a dense key/value head) against the float32 reference, bf16, two shapes; each call run
three times (the counters and tickets must come back to zero: the same bits every time).

python fwd_smoke.py            (prints one line per case; exits 1 on a mismatch)
"""
import sys
import time

import torch

from hf_hilbert_attn import dilated_attention, reference_attention
from hf_hilbert_attn.patterns import as_pattern

torch.manual_seed(0)
bad = 0
pats = {n: as_pattern(n) for n in ("default", "longnet_lm", "sliding_sparse", "pow2")}
pats["default+kv0"] = pats["default"].replace(dense_kv_heads=(0,))
for (hq, hkv, d, s) in ((32, 8, 128, 4096), (4, 2, 64, 16384), (9, 3, 64, 5000)):
    q = torch.randn(1, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    for name, p in pats.items():
        t0 = time.perf_counter()
        outs = [dilated_attention(q, k, v, p, return_lse=True, backend="triton") for _ in range(3)]
        torch.cuda.synchronize()
        ro, rl = reference_attention(q, k, v, p, return_lse=True)
        o, lse = outs[0]
        rel = ((o.float() - ro).norm() / ro.norm()).item()
        lerr = (lse - rl).abs().max().item()
        same = all(torch.equal(o, x[0]) and torch.equal(lse, x[1]) for x in outs[1:])
        ok = rel < 1e-2 and lerr < 1e-2 and same and not torch.isnan(o).any()
        bad += not ok
        print(f"{name:14s} {hq}/{hkv}x{d} S={s}: rel {rel:.2e} lse {lerr:.2e} repeat-equal {same} "
              f"{'ok' if ok else 'BAD'} ({time.perf_counter() - t0:.1f} s)", flush=True)
sys.exit(1 if bad else 0)
