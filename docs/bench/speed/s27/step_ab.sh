#!/bin/bash
# The 135M training step at 4K beside SDPA, this tree and the previous commit (.scratch/base)
# in turn, twice (called by run_ab1.sh and run_ab3.sh).
for r in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 "$v-r$r" 2>&1 | grep 135m
  done
done
