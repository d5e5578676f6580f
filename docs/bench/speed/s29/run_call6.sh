#!/bin/bash
# Device call 6 of session 29: the GPU suite on the final commit (cold Triton cache).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 330 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite_final_H200.txt 2>&1
tail -9 $OUT/gpu_suite_final_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_final_H200.txt | head
echo "gpu suite wall $(( $(date +%s) - t0 )) s"
