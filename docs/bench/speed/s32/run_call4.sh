#!/bin/bash
# Device call 4 of session 32: the GPU suite on the final tree (D75 and the simplifications),
# then 1B decoding again, new against base (the previous session's commit, .scratch/base).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 330 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite_H200.txt 2>&1
tail -9 $OUT/gpu_suite_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_H200.txt | head
echo "gpu suite wall $(( $(date +%s) - t0 )) s"
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 80 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 10 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
