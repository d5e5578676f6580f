"""The dq launches' key loops compiled for sm_90 on the CPU (as fwd_loops.py): registers, spills and,
per loop, (SASS instructions, spill stores, spill loads).

    PYTHONSAFEPATH=1 PYTHONPATH=/tmp/tr36site:$PWD python docs/bench/speed/s48/dq_loops.py default [128]
"""
import sys, os, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fwd_loops import loops
from hf_hilbert_attn.tools import aot
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn import DilatedPattern
D=int(sys.argv[2]) if len(sys.argv)>2 else 128; S=4096
q=torch.empty(1,4,S,D,dtype=torch.bfloat16); k=torch.empty(1,1,S,D,dtype=torch.bfloat16)
name=sys.argv[1]
pattern = DilatedPattern.dense(S) if name == "dense" else as_pattern(name)
for fn, grid, args, kwargs in aot.launches(q, k, k, pattern, backward=True):
    if fn.__name__ != '_dq_kernel': continue
    row, kern = aot._compile(fn, args, kwargs, 90, True)
    print(name, D, row['variant'][:22], 'EARLIER', kwargs['F'].EARLIER, 'regs', row['registers'], 'spills', row['spill_stores'], row['spill_loads'], 'loops', [(len(b), sum('STL' in x for x in b), sum('LDL' in x for x in b)) for b in loops(kern.asm['cubin'])])
