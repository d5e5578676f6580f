"""Backward tiles at the shapes short training steps run (a tile search, one process): per
kernel GPU time (profiler) and fwd+bwd ms (do_bench) of the default pattern for each tile
override, beside SDPA's flash and cuDNN fwd+bwd on the same shape.

python small_tiles.py HQ/HKV/D:S,S,..[@PATTERN] ...   e.g. 9/3/64:4096,8192,16384 32/8/64:65536@longnet_lm
(VARIANTS=first,second,...: only those variants, by name prefix)
"""
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import configure
from hf_hilbert_attn.patterns import as_pattern

VARIANTS = {
    "base": None,
    "dkdv 32x64 w4 s2": {"dkdv": (32, 64, 4, 2)},
    "dkdv 64x64 w8 s2": {"dkdv": (64, 64, 8, 2)},
    "dkdv 16x64 w4 s3": {"dkdv": (16, 64, 4, 3)},
    "dq 64x64 w4 s3": {"dq": (64, 64, 4, 3)},
    "dq 64x32 w4 s3": {"dq": (64, 32, 4, 3)},
    "both 32x64 / 64x64": {"dkdv": (32, 64, 4, 2), "dq": (64, 64, 4, 3)},
    "both 16x64 / 64x64": {"dkdv": (16, 64, 4, 3), "dq": (64, 64, 4, 3)},
    # head size 128: 8 warps (with 4 they spill more on sm_90: tile_screen_d128_sm90_cpu.txt)
    "d128 dq 64x64 w8 s3": {"dq": (64, 64, 8, 3)},
    "d128 dkdv 16x64 w8 s3": {"dkdv": (16, 64, 8, 3)},
    "d128 dkdv 32x64 w8 s2": {"dkdv": (32, 64, 8, 2)},
    "d128 both": {"dkdv": (16, 64, 8, 3), "dq": (64, 64, 8, 3)},
}
if os.environ.get("VARIANTS"):
    VARIANTS = {k: v for k, v in VARIANTS.items()
                if any(k.startswith(p) for p in os.environ["VARIANTS"].split(","))}
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)


def fb(fn, q, k, v, g):
    def run():
        fn(q, k, v).backward(g)
    return run


def kernels_ms(run):
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name.split("_kernel")[0].lstrip("_")[:6]] += e.device_time / 1e3
    return by


for spec in sys.argv[1:]:
    spec, _, pname = spec.partition("@")
    pat = as_pattern(pname or "default")
    heads, seqs = spec.split(":")
    hq, hkv, d = (int(x) for x in heads.split("/"))
    for s in (int(x) for x in seqs.split(",")):
        q = torch.randn(1, hq, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(q)
        ref = {}
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def sd(q, k, v, be=be):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                ref[name] = triton.testing.do_bench(fb(sd, q, k, v, g), rep=200, return_mode="median",
                                                    grad_to_none=[q, k, v])
            except RuntimeError as e:  # a backend refusing the shape
                ref[name] = float("nan")
                print(f"  {name}: {str(e)[:80]}")
        print(f"== {pname or 'default'} Hq/Hkv/D {hq}/{hkv}/{d} S={s}: SDPA fwd+bwd flash {ref['flash']:.3f} ms, "
              f"cudnn {ref['cudnn']:.3f} ms", flush=True)
        for name, blocks in VARIANTS.items():
            configure(blocks=blocks)
            run = fb(lambda q, k, v: dilated_attention(q, k, v, pat), q, k, v, g)
            by = kernels_ms(run)
            ms = triton.testing.do_bench(run, rep=200, return_mode="median", grad_to_none=[q, k, v])
            parts = "  ".join(f"{n} {t:.3f}" for n, t in sorted(by.items()) if t > 0.001)
            print(f"  {name:22s} fwd+bwd {ms:.3f} ms (x{ref['flash'] / ms:.2f} flash)  kernels: {parts}",
                  flush=True)
        configure(blocks=None)
