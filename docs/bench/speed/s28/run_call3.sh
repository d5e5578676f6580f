#!/bin/bash
# Device call 3 of session 28: prepared calls (the layers of a forward run the op's prepared
# call; the kernels' runners) against the previous commit (.scratch/base): the 135M step at 4K
# beside SDPA, new / base twice; then the attention calls' host time inside the step.
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
bash docs/bench/speed/s27/step_ab.sh 2>&1 | tee $OUT/ab_step.txt
for v in new base new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base:$PWD; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P python docs/bench/speed/s28/scripts/step_insitu.py 135m 4096 8 1 2>&1 | grep round
done | tee $OUT/ab_insitu.txt
