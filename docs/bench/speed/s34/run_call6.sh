#!/bin/bash
# Device call 6 of session 34: the GPU suite from a cold Triton cache on the final tree (the
# union kernels' two copies kept, the library simplified), then 1B decoding at 128K / 256K with a
# dense key/value head's programs evaluating no rule (the others as in call 4).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc6
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 200 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=10 tests \
  > $OUT/gpu_suite_cold.txt 2>&1
tail -14 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
echo "cold suite wall $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 60 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py > $OUT/decode_tests.txt 2>&1
tail -1 $OUT/decode_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/decode_tests.txt | head
PYTHONPATH=$PWD timeout 120 python docs/bench/speed/s19/scripts/interleave.py 1b 131072,262144 10 final \
  2>&1 | grep -v Warn | tee $OUT/decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
