#!/bin/bash
# Session 47, call 2: why call 1's 135M step fell (0.952 -> 0.856 at 4K): the tree, the tree with
# the dk/dv launches with earlier configs back on the Triton kernel, session 45's package
# (commit 7df1378 copied to docs/bench/speed/s47/old first, not committed: `git worktree add
# /tmp/old45 7df1378 && cp -r /tmp/old45/hf_hilbert_attn docs/bench/speed/s47/old/`), each beside SDPA; and
# host time per call (host_overhead.py) for the tree and the old package.
export PYTHONUNBUFFERED=1
S=docs/bench/speed/s47
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
PYTHONSAFEPATH=1 PYTHONPATH=$PWD/$S/old python -c "import hf_hilbert_attn; print(hf_hilbert_attn.__file__)" | tee -a $OUT/card.txt
for r in 1 2; do
PYTHONPATH=$PWD timeout 150 python $S/stepinter_rule.py 135m 4096,16384 6 "tree$r" 2>&1 | grep -v -i warn | tee -a $OUT/step_ab.txt
OLD_RULE=1 PYTHONPATH=$PWD timeout 150 python $S/stepinter_rule.py 135m 4096,16384 6 "triton-rule$r" 2>&1 | grep -v -i warn | tee -a $OUT/step_ab.txt
PYTHONPATH=$PWD/$S/old timeout 150 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 6 "s45-pkg$r" 2>&1 | grep -v -i warn | tee -a $OUT/step_ab.txt
done
for t in "$PWD" "$PWD/$S/old"; do
PYTHONPATH=$t timeout 60 python examples/benchmarks/host_overhead.py --seq 4096 2>&1 | grep -v -i warn | tee -a $OUT/host_4k.txt
done
