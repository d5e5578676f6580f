#!/bin/bash
# Device call 4 of session 29: the GPU suite on this tree (head size 64's new backward tiles,
# the delta pass zeroing the sink sums, launches without empty hook chains), then this tree
# ("new") against the previous commit ("base", .scratch/base): the op at head size 64 (default
# pattern, each tree's own tiles) and 1B decoding, both caches, with and without a dense head.
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 290 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite_H200.txt 2>&1
tail -9 $OUT/gpu_suite_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_H200.txt | head
echo "gpu suite wall $(( $(date +%s) - t0 )) s"
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P VARIANTS=base timeout 80 python docs/bench/speed/s29/scripts/small_tiles.py \
    9/3/64:4096,16384 32/8/64:4096,16384,65536 2>&1 | grep -E "==|base"
done | tee $OUT/ab_op_d64_H200.txt
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 90 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 10 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
