#!/bin/bash
# Device call 4 of session 34: decoding in a cache's own layout skips the key tiles no window
# of the step reaches. Decode tests on the GPU (tests/test_decode.py runs on CUDA unmarked, the
# GPU suite's decode and cache tests), then 1B decoding interleaved, this tree against the
# previous commit (.scratch/base).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc4
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 200 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py \
  > $OUT/decode_tests.txt 2>&1; tail -2 $OUT/decode_tests.txt
PYTHONPATH=$PWD timeout 200 python -m pytest -q -n 8 -p no:benchmark -m gpu -k "decode or cache or generate" tests \
  > $OUT/gpu_decode_tests.txt 2>&1; tail -2 $OUT/gpu_decode_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/*tests.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 240 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768,131072,262144 20 new \
  2>&1 | grep -v Warn | tee $OUT/decode_1b_new_H200.txt
PYTHONPATH=$PWD/.scratch/base timeout 150 python docs/bench/speed/s19/scripts/interleave.py 1b 131072,262144 20 base \
  2>&1 | grep -v Warn | tee $OUT/decode_1b_base_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
