"""Which kernel specializations each ``_check``-based GPU test of tests/test_kernels_gpu.py
would compile (sm_90 tiles), recorded on a CPU without a GPU: the tests' CUDA tensors are made
on the CPU, the op is routed to the kernels, and their launches go to the launch hook (nothing
runs). Arguments: substrings of test ids whose specializations are then compiled for sm_90 one
at a time and timed. Run from the repository root:

    python docs/bench/speed/s40/suite_specs.py [TEST_ID_SUBSTRING ...]

(``test_`` selects every test; a fresh ``TRITON_CACHE_DIR`` for compile times.)
"""
import os, sys, inspect, collections, json
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "tests")
import torch
for name in ("randn", "randperm", "arange", "tensor", "zeros", "ones", "full", "empty", "randint", "rand", "zeros_like", "empty_like", "ones_like", "randn_like", "as_tensor"):
    f = getattr(torch, name)
    def w(*a, _f=f, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return _f(*a, **k)
    setattr(torch, name, w)
torch.Tensor.cuda = lambda self, *a, **k: self
import hf_hilbert_attn.ops as ops
ops.use_triton = lambda *a, **k: True
import hf_hilbert_attn.kernels as K
from hf_hilbert_attn.tools import aot
import test_kernels_gpu as T
from hf_hilbert_attn import dilated_attention

calls = []
K.set_launch_hook(calls.extend)
per_test = collections.defaultdict(set)
current = [None]
example = {}

def fake_check(pattern, *, s, hq=4, hkv=2, d=128, sq=None, dtype=torch.bfloat16, causal=True, b=1,
               fn=dilated_attention, **kw):
    sq = sq or s
    q = torch.randn(b, hq, sq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    kw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    calls.clear()
    out = fn(q, k, v, pattern, causal=causal, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    for jit_fn, grid, args, kwargs in calls:
        try:
            key = aot.spec_key(jit_fn, args, kwargs, 90)
        except Exception as e:  # noqa
            key = ("?", jit_fn.__name__, repr(e)[:60])
        per_test[current[0]].add((jit_fn.__name__, key))
        example.setdefault((jit_fn.__name__, key), (jit_fn, args, kwargs))

T._check = fake_check
T._poison = lambda: None
for name, f in inspect.getmembers(T, inspect.isfunction):
    if not name.startswith("test_") or "_check(" not in inspect.getsource(f):
        continue
    params = [()]
    names = []
    for m in getattr(f, "pytestmark", []):
        if m.name == "parametrize":
            names = [n.strip() for n in m.args[0].split(",")]
            params = [tuple(getattr(p, "values", p if isinstance(p, tuple) else (p,))) for p in m.args[1]]
    for p in params:
        tid = name + (str(list(p)) if p else "")
        current[0] = tid
        try:
            args = dict(zip(names, p))
            if "monkeypatch" in inspect.signature(f).parameters:
                import pytest
                mp = pytest.MonkeyPatch(); args["monkeypatch"] = mp
            f(**args)
        except Exception as e:
            print(f"{tid}: {type(e).__name__}: {str(e)[:100]}")
allkeys = collections.Counter(k for ks in per_test.values() for k in ks)
print(f"\n{len(allkeys)} distinct specializations over {len(per_test)} tests")
for tid, ks in sorted(per_test.items(), key=lambda x: -len(x[1])):
    uniq = sum(1 for k in ks if allkeys[k] == 1)
    kinds = collections.Counter(n for n, _ in ks)
    print(f"{tid:70s} {len(ks):3d} specs, {uniq:3d} only here  {dict(kinds)}")

import time
want = sys.argv[1:]
tot = collections.defaultdict(float)
compiled, by_variant = set(), {}
for tid, ks in per_test.items():
    if not any(w in tid for w in want):
        continue
    for k in sorted(ks, key=str):
        jit_fn, args, kwargs = example[k]
        t0 = time.perf_counter()
        try:
            aot.compile_launch(jit_fn, args, kwargs, 90, resources=False)
        except Exception as e:
            print("compile failed", repr(e)[:80])
        dt = time.perf_counter() - t0
        tot[tid] += dt
        flags = {n: v for n, v in aot.constexpr_values(jit_fn, aot.specialize(
            jit_fn, args, kwargs, 90)[1]).items() if n in ("BM", "BN", "EARLIER", "MIXED", "SINK")}
        print(f"  {tid[:50]:50s} {k[0]:14s} {dt:5.1f} s  {flags}")
        if k not in compiled:  # (the first test to need it compiles it; later ones hit the cache)
            compiled.add(k)
            row = by_variant.setdefault((k[0], flags.get("EARLIER"), flags.get("MIXED"),
                                         flags.get("SINK")), [0, 0.0])
            row[0], row[1] = row[0] + 1, row[1] + dt
for tid, t in tot.items():
    print(f"{tid}: {t:.1f} s compile (sm_90, this CPU, one at a time)")
# (session 52) the compiles (not the cache hits of specializations an earlier test made) by
# kernel and union flags: where the compile time goes
if want:
    print("\n| kernel | EARLIER | MIXED | SINK | compiles | seconds | each |\n|---|---|---|---|---|---|---|")
    for (n, e, m, sk), (c, t) in sorted(by_variant.items(), key=lambda x: -x[1][1]):
        print(f"| {n} | {e} | {m} | {sk} | {c} | {t:.1f} | {t / c:.1f} |")
    print(f"| all | | | | {sum(c for c, _ in by_variant.values())} | "
          f"{sum(t for _, t in by_variant.values()):.1f} | |")
