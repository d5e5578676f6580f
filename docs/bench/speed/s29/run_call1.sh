#!/bin/bash
# Device call 1 of session 29: backward tiles at short-step shapes (135M: 9/3 heads x 64; 1B:
# 32/8 x 64), then the 135M step beside SDPA at 4K / 8K / 16K (previous commit's code).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 330 python docs/bench/speed/s29/scripts/small_tiles.py 9/3/64:4096,8192,16384 32/8/64:4096,16384 \
  2>&1 | grep -v Warn | tee $OUT/small_tiles_H200.txt
echo "tiles wall $(( $(date +%s) - t0 )) s"
timeout 200 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,8192,16384 10 base 2>&1 | grep 135m \
  | tee $OUT/step_4k_16k_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
