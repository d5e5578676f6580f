"""The Gluon dk/dv kernel on launches with earlier configs (no per-pair union mask: not MIXED;
session 46) against the Triton dk/dv kernel on those launches, in one process: per kernel GPU
ms (profiler), fwd+bwd ms (do_bench) and the gradients' largest difference ÷ largest gradient.

    python docs/bench/speed/s46/earlier.py 32/8/128:65536@pow2 32/8/128:65536@longnet_lm

``triton`` runs the plan with the kernel's eligibility as before (no earlier config), so only
those launches change; the profiler names the Gluon kernel ``dkdv_wgmma``.
"""
import os
import sys

import torch
import triton

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import _calls, _dkdv_wgmma, configure
from hf_hilbert_attn.patterns import as_pattern

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "s44"))
from tiles import gpu_ms_by_kernel  # noqa: E402

NEW = _dkdv_wgmma.eligible


def old(flags, c):
    return not flags.EARLIER and NEW(flags, c)


def main():
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for arg in sys.argv[1:]:
        shape, _, pname = arg.partition("@")
        heads, seqs = shape.split(":")
        hq, hkv, d = (int(x) for x in heads.split("/"))
        for s in (int(x) for x in seqs.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(s)
            q, k, v, g = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16,
                                      generator=gen) for h in (hq, hkv, hkv, hq))
            for t in (q, k, v):
                t.requires_grad_(True)
            pattern = as_pattern(pname)

            def step():
                dilated_attention(q, k, v, pattern).backward(g)

            print(f"== {pname} {hq}/{hkv}/{d} S={s}", flush=True)
            base = None
            for name, rule in (("gluon earlier", NEW), ("triton earlier", old),
                               ("gluon earlier", NEW)):
                _dkdv_wgmma.eligible = rule
                _calls._CALLS.clear()
                configure()  # (a new configuration: the prepared calls plan anew)
                q.grad = k.grad = v.grad = None
                step()
                grads = [t.grad.float() for t in (q, k, v)]
                base = grads if base is None else base
                diff = max(float((a - b).abs().max() / b.abs().max())
                           for a, b in zip(grads, base))
                by = gpu_ms_by_kernel(step)
                ms = triton.testing.do_bench(step, rep=200, return_mode="median",
                                             grad_to_none=[q, k, v])
                parts = "  ".join(f"{n} {t:.3f}" for n, t in sorted(by.items()))
                print(f"  {name:16s} fwd+bwd {ms:8.3f} ms  grad diff {diff:.1e}  {parts}",
                      flush=True)
            _dkdv_wgmma.eligible = NEW


if __name__ == "__main__":
    main()
