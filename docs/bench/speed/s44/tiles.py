"""Backward tiles timed with the device's own Triton (a tile search in one process): per kernel
GPU time (profiler) and fwd+bwd ms (do_bench) for each tile override, and each override's
gradients beside the library's tiles (largest difference ÷ largest gradient: rounding only).

    python docs/bench/speed/s44/tiles.py HQ/HKV/D:S,S[@PATTERN] ... \
        --tile "dkdv 32x128 w8 s1=dkdv:32,128,8,1" --tile "..."

A variant is ``name=kind:BM,BN,warps,stages[+kind:...]`` (kinds as ``HF_HILBERT_*_BLOCKS``:
fwd, fwd1, dq, dkdv); the library's own tiles run first as ``base``. An override of the dk/dv
tile also turns the Gluon dk/dv kernel off (D92): ``dkdv:32,128,8,2`` is the Triton kernel with
its own tile. ``GLUON_BM=64``: the Gluon kernel with 64 queries a step (D92's prototype's best).
"""
import argparse
import os
from collections import defaultdict

import torch
import triton

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.kernels import configure
from hf_hilbert_attn.kernels import _dkdv_wgmma
from hf_hilbert_attn.patterns import as_pattern

if os.environ.get("GLUON_BM"):
    _dkdv_wgmma.BM = int(os.environ["GLUON_BM"])


def parse_tile(text):
    name, _, spec = text.partition("=")
    blocks = {}
    for part in spec.split("+"):
        kind, _, nums = part.partition(":")
        blocks[kind] = tuple(int(x) for x in nums.split(","))
    return name, blocks


def gpu_ms_by_kernel(step):
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "_kernel" in ev.name:
            out[ev.name.split("_kernel")[0].lstrip("_")] += ev.device_time / 1e3
    return out


def cases(shapes):
    """``(label, step, (q, k, v))`` of each ``HQ/HKV/D:S,S[@PATTERN]``: bf16 inputs (seeded by
    the length) and one forward + backward of the library on them."""
    for shape in shapes:
        shape, _, pname = shape.partition("@")
        pattern = as_pattern(pname or "default")
        heads, seqs = shape.split(":")
        hq, hkv, d = (int(x) for x in heads.split("/"))
        for s in (int(x) for x in seqs.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(s)
            q, k, v, g = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16,
                                      generator=gen) for h in (hq, hkv, hkv, hq))
            for t in (q, k, v):
                t.requires_grad_(True)

            def step(q=q, k=k, v=v, g=g, pattern=pattern):
                dilated_attention(q, k, v, pattern).backward(g)

            yield f"{pname or 'default'} {hq}/{hkv}/{d} S={s}", step, (q, k, v)


def measure(name, step, qkv, base):
    """One variant's line (per kernel GPU ms, fwd+bwd ms, gradients against ``base``'s, None:
    these are the base); returns its gradients."""
    for t in qkv:
        t.grad = None
    step()
    grads = [t.grad.float() for t in qkv]
    diff = 0.0 if base is None else max(float((a - b).abs().max() / b.abs().max())
                                        for a, b in zip(grads, base))
    by = gpu_ms_by_kernel(step)
    ms = triton.testing.do_bench(step, rep=200, return_mode="median", grad_to_none=list(qkv))
    parts = "  ".join(f"{n} {t:.3f}" for n, t in sorted(by.items()))
    print(f"  {name:20s} fwd+bwd {ms:8.3f} ms  grad diff {diff:.1e}  {parts}", flush=True)
    return grads


def compare_rules(shapes, old_rule, what):
    """The cases of ``shapes`` with the Gluon dk/dv kernel's eligibility as the library has it,
    then ``old_rule``, then as it has it again, in one process (``what``: the launches that
    differ, in the labels); each run plans anew."""
    from hf_hilbert_attn.kernels import _calls

    new = _dkdv_wgmma.eligible
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for label, step, qkv in cases(shapes):
        print(f"== {label}", flush=True)
        base = None
        for name, rule in ((f"gluon {what}", new), (f"triton {what}", old_rule),
                           (f"gluon {what}", new)):
            _dkdv_wgmma.eligible = rule
            _calls._CALLS.clear()
            configure()  # (a new configuration: the prepared calls plan anew)
            grads = measure(name, step, qkv, base)
            base = grads if base is None else base
        _dkdv_wgmma.eligible = new


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+")
    ap.add_argument("--tile", action="append", default=[], type=parse_tile)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          flush=True)
    for label, step, qkv in cases(args.shapes):
        print(f"== {label}", flush=True)
        base = None
        for name, blocks in [("base", None)] + args.tile:
            configure(blocks=blocks)
            grads = measure(name, step, qkv, base)
            base = grads if base is None else base
        configure(blocks=None)


if __name__ == "__main__":
    main()
