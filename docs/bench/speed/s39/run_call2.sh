#!/bin/bash
# Device call 2 of session 39: the sink keys' dk/dv sums back in the first launch where it has a
# program for every key (D83): the per-config profile at 64K, then the GPU kernel tests with
# sinks and sliding windows, as the call's time allows (BUDGET seconds, default 200).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
S=docs/bench/speed/s39 B=${BUDGET:-200}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
timeout 80 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --profile \
  --pattern default sliding_sparse --csv $OUT/profile_64k.csv 2>&1 | grep -v -i warn | tee $OUT/profile_64k.txt
echo "profile wall $(( $(date +%s) - t0 )) s"
timeout $(( B - $(date +%s) + t0 )) python -m pytest -q -m gpu -n 16 -p no:benchmark \
  tests/test_kernels_gpu.py -k "sink or sliding or modes or longnet" > $OUT/gpu_kernel_tests.txt 2>&1
tail -1 $OUT/gpu_kernel_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_kernel_tests.txt
echo "total wall $(( $(date +%s) - t0 )) s"
