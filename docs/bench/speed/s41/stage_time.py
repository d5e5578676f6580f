"""Triton's compile stages timed: runs examples/benchmarks/kernel_resources.py with each stage of
the NVIDIA backend wrapped; the seconds per stage go to stderr at the end. From the repository
root: python docs/bench/speed/s41/stage_time.py --seq 65536 --pattern longnet_lm"""
import sys, time, runpy, collections
from triton.backends.nvidia import compiler as C
T = collections.defaultdict(float)
orig = C.CUDABackend.add_stages
def add_stages(self, stages, options, language=None):
    try:
        orig(self, stages, options, language)
    except TypeError:
        orig(self, stages, options)
    for k, f in list(stages.items()):
        def w(*a, _f=f, _k=k):
            t = time.perf_counter(); r = _f(*a); T[_k] += time.perf_counter() - t; return r
        stages[k] = w
C.CUDABackend.add_stages = add_stages
sys.argv = ["kernel_resources.py"] + sys.argv[1:]
import os
try:
    runpy.run_path("examples/benchmarks/kernel_resources.py", run_name="__main__")
finally:
    print({k: round(v, 1) for k, v in T.items()}, file=sys.stderr)
