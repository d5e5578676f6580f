#!/bin/bash
# Device call 5 of session 30: the 135M training step at 4K / 8K / 16K beside SDPA (steps
# interleaved), this tree ("new") and the previous commit ("base", .scratch/base) in turn, twice.
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
for r in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,8192,16384 6 "$v-r$r" 2>&1 | grep 135m
  done
done | tee $OUT/ab_step_135m_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
