#!/bin/bash
# Device call 4 of session 30: the GPU suite on this tree (decoding in the cache's layout, the
# runners' relaunch of a call like their last), then this tree ("new") against the previous
# commit ("base", .scratch/base): host µs of the attention calls inside a 135M training step at
# 4K beside SDPA, the decode step's attention and mask functions inside steps (1B, 4K), and
# ms per token beside SDPA flash (1B, 4K / 32K, both caches, with and without a dense head).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 290 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite_H200.txt 2>&1
tail -9 $OUT/gpu_suite_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_H200.txt | head
echo "gpu suite wall $(( $(date +%s) - t0 )) s"
for v in new base new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P timeout 60 python docs/bench/speed/s28/scripts/step_insitu.py 135m 4096 6 1 2>&1 | grep -E "round|NVIDIA"
done | tee $OUT/step_insitu_4k_H200.txt
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P timeout 60 python docs/bench/speed/s30/scripts/decode_insitu.py 1b 4096 20 2>&1 | grep -v -i warn
done | tee $OUT/decode_insitu_1b_4k_H200.txt
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 80 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 10 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
