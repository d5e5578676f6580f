#!/bin/bash
# Device call 2 of session 38: the PatternCache append with fewer host ops and one copy per cut
# (D82). Its GPU tests; in place against concatenated, order rotated per round, at 4K and 128K;
# `bench generate --preset 1b` (sdpa, sdpa flash, default, default + dense kv head 0; both
# caches; 4K-1M); then the GPU suite with its durations, as long as the call has time.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc2 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
timeout 90 python -m pytest -q -n 4 -p no:benchmark -m gpu -k "pattern_cache or cached_generate" tests \
  > $OUT/gpu_cache_tests.txt 2>&1; tail -1 $OUT/gpu_cache_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/*tests.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 100 python docs/bench/speed/s38/cache_ab2.py \
  4096,131072 12 2>&1 | grep -v Warn | tee $OUT/cache_ab2.txt
echo "cache wall $(( $(date +%s) - t0 )) s"
timeout 330 python -m hf_hilbert_attn.tools.cli bench generate --preset 1b --out-dir $OUT 2>&1 \
  | grep -v Warn | tee $OUT/bench_generate_1b.log
echo "generate wall $(( $(date +%s) - t0 )) s"
left=$(( 585 - $(date +%s) + t0 ))
if [ $left -gt 100 ]; then
  TRITON_CACHE_DIR=/tmp/tc3 timeout $left python -m pytest -q -m gpu -n 16 --durations=15 tests \
    > $OUT/gpu_suite_cold.txt 2>&1; tail -1 $OUT/gpu_suite_cold.txt
fi
echo "total wall $(( $(date +%s) - t0 )) s"
