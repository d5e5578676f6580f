#!/bin/bash
# Device call 1 of session 34: the GPU suite from a cold Triton cache with every compile logged
# (compile_log.py: kernel, cache key, seconds, test), then again warm (what compiling costs);
# then the 135M attention shape (9 / 3 heads x 64) per config and per kernel at 4K and 16K.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc COMPILE_LOG=$OUT/compiles.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD:$PWD/docs/bench/speed/s34 timeout 330 python -m pytest -q -m gpu -n 16 -p no:benchmark \
  -p compile_log --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -3 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
echo "cold suite wall $(( $(date +%s) - t0 )) s"; t1=$(date +%s)
COMPILE_LOG=$OUT/compiles_warm.jsonl PYTHONPATH=$PWD:$PWD/docs/bench/speed/s34 timeout 200 python -m pytest -q -m gpu -n 16 \
  -p no:benchmark -p compile_log --durations=0 tests > $OUT/gpu_suite_warm.txt 2>&1
tail -1 $OUT/gpu_suite_warm.txt; echo "warm suite wall $(( $(date +%s) - t1 )) s"
PYTHONPATH=$PWD timeout 200 python examples/benchmarks/kernel_timing.py --no-check --seq 4096 16384 \
  --hq 9 --hkv 3 --dim 64 --pattern default --dense --profile > $OUT/timing_135m_shape.txt 2>&1
tail -40 $OUT/timing_135m_shape.txt
echo "total wall $(( $(date +%s) - t0 )) s"
