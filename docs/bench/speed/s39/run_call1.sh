#!/bin/bash
# Device call 1 of session 39: (1) s38's last PatternCache order (8db0be3) on a GPU: its tests
# and the in-room / concatenated A/B at 4K and 128K; (2) issue 34: dk/dv programs only for the
# classes a group reads (this tree) against the previous commit (.scratch/base: `git archive
# HEAD hf_hilbert_attn`), per config and kernel at 64K, default and sliding_sparse with and
# without their sink token; the GPU kernel tests; (3) the GPU suite cold with every duration.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
S=docs/bench/speed/s39
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
timeout 200 python -m pytest -q -n 8 -p no:benchmark -m gpu -k "pattern_cache or cached_generate" \
  tests tests/test_kernels_gpu.py tests/test_sinks_sliding.py > $OUT/gpu_tests.txt 2>&1
tail -1 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 110 python docs/bench/speed/s38/cache_ab2.py \
  4096,131072 12 2>&1 | grep -v Warn | tee $OUT/cache_ab2.txt
echo "cache wall $(( $(date +%s) - t0 )) s"
for tag in base new base2 new2; do
  pkg=$PWD; [ ${tag:0:4} = base ] && pkg=$PWD/.scratch/base
  echo "=== $tag" | tee -a $OUT/profile_64k.txt
  PYTHONPATH=$pkg timeout 120 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 \
    --profile --pattern default $S/default_nosink.yaml sliding_sparse $S/sliding_sparse_nosink.yaml \
    --csv $OUT/profile_64k_$tag.csv 2>&1 | grep -v -i warn | tee -a $OUT/profile_64k.txt
  echo "profile $tag wall $(( $(date +%s) - t0 )) s"
done
left=$(( 590 - $(date +%s) + t0 ))
TRITON_CACHE_DIR=/tmp/tc2 timeout $left python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=0 tests \
  > $OUT/gpu_suite_cold.txt 2>&1; tail -1 $OUT/gpu_suite_cold.txt
echo "total wall $(( $(date +%s) - t0 )) s"
