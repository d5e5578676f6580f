#!/bin/bash
# Device call 1 of session 38: the in-place PatternCache append (s37, D81) on a GPU. GPU tests
# of decoding, caches and generate; PatternCache in place / concatenated beside a DynamicCache at
# 128K and 1M; 1B decoding at 4K / 32K, both caches, +- dense head 0, beside SDPA; the 135M step.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
timeout 110 python -m pytest -q -n 16 -p no:benchmark -m gpu -k "decode or cache or generate" tests \
  > $OUT/gpu_cache_tests.txt 2>&1; tail -1 $OUT/gpu_cache_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/*tests.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 230 python docs/bench/speed/s37/cache_ab.py \
  131072,1048576 10 2>&1 | grep -v Warn | tee $OUT/cache_ab.txt
echo "cache wall $(( $(date +%s) - t0 )) s"
timeout 120 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 10 s38 2>&1 | grep -v Warn \
  | tee $OUT/decode_1b.txt
echo "decode wall $(( $(date +%s) - t0 )) s"
timeout $(( 590 - $(date +%s) + t0 )) python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 5 s38 \
  2>&1 | grep -v Warn | tee $OUT/step_135m.txt
echo "total wall $(( $(date +%s) - t0 )) s"
