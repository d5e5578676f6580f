#!/bin/bash
# Device call 3 of session 34: the GPU suite from a cold Triton cache on the final tree (dq's
# key ranges through one copy of its tile loops, the units re-planned), then 1B decoding at
# 4K / 32K / 128K, every method stepped in turn in one process (the README's decoding table).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc3
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 300 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=20 tests \
  > $OUT/gpu_suite_cold.txt 2>&1
tail -23 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
echo "cold suite wall $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 330 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768,131072 20 s34 \
  2>&1 | grep -v Warn | tee $OUT/decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
