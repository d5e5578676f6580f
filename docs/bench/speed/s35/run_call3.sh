#!/bin/bash
# Device call 3 of session 35 (final tree): the GPU suite from a cold Triton cache (Phi-3's
# head-size test on one config), the decode tests, then 1B decoding at 1M tokens of context
# (as run: without expandable segments, which ran out of memory; rerun as written here: call 4).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc3
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 170 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=12 tests \
  > $OUT/gpu_suite_cold.txt 2>&1
tail -16 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
echo "cold suite wall $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 60 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py > $OUT/decode_tests.txt 2>&1
tail -1 $OUT/decode_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/decode_tests.txt | head
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD timeout 150 python docs/bench/speed/s35/decode_long.py 1048576 10 2>&1 | grep -v Warn | tee $OUT/decode_1m.txt
echo "total wall $(( $(date +%s) - t0 )) s"
