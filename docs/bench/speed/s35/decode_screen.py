"""Compile the decode kernel for sm_90 on the CPU (nothing runs): registers, spills, and whether
the key loop's loads are asynchronous copies (software-pipelined) in the TritonGPU IR.

    python docs/bench/speed/s35/decode_screen.py [--dense] [--sk 262144]
"""
import argparse

import torch

from hf_hilbert_attn import decode
from hf_hilbert_attn.decode import plan_decode
from hf_hilbert_attn.kernels import _decode
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools import aot

p = argparse.ArgumentParser()
p.add_argument("--dense", action="store_true")
p.add_argument("--sk", type=int, default=262144)
p.add_argument("--hq", type=int, default=32)
p.add_argument("--hkv", type=int, default=8)
p.add_argument("--dim", type=int, default=64)
args = p.parse_args()
pat = as_pattern("default")
if args.dense:
    pat = pat.replace(dense_kv_heads=(0,))
seen = []
_decode.launch_all = lambda launches, memo=None: seen.extend(launches)  # record, run nothing
_decode._sms = lambda device: 132  # an H100's SMs
q = torch.randn(1, args.hq, 1, args.dim, dtype=torch.bfloat16)
k = torch.randn(1, args.hkv, args.sk, args.dim, dtype=torch.bfloat16)
plan = plan_decode(pat, args.hq, args.hkv, args.sk, args.sk - 1, None)
launcher = decode._launcher(plan, q)
out = torch.empty_like(q)
launcher(q, k, k, args.dim ** -0.5, out, qbase=args.sk - 1)
fn, grid, head, rest, kwargs = seen[0]
print("grid", grid, "NSPLIT / NSPLIT_D", rest[8:10])
row, kernel = aot._compile(fn, (*head, *rest), kwargs, 90, True)
ttgir = kernel.asm["ttgir"]
print({k: row[k] for k in ("registers", "spill_stores", "spill_loads", "shared", "compile_s")})
print("async copies in the IR:", ttgir.count("async_copy_global_to_local"),
      " waits:", ttgir.count("async_wait"), " scf.for:", ttgir.count("scf.for"))
