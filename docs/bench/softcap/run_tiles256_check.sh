#!/bin/bash
# Session 24, one GPU: the head-size-256 tiles chosen from run_tiles256.sh (D66) in the code:
# the GPU tests that run head size 256 (kernels, soft-capping, MLA / Phi padded to 256, Gemma 2),
# then the timing again (default and dense on our kernels, per kernel).
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
timeout 300 python -m pytest -q -n 8 -p no:benchmark tests/test_kernels_gpu.py tests/test_head_sizes.py \
  tests/test_softcap.py -m gpu -k "256 or soft or head_sizes or gemma" 2>&1 | tail -4 \
  | tee $o/tests256.log
timeout 150 python examples/benchmarks/kernel_timing.py --no-check --pattern default --dense \
  --seq 32768 --hq 16 --hkv 8 --dim 256 --profile --softcap 50 --csv $o/d256.csv 2>&1 \
  | grep -v "Warn\|warn" | tail -30 | tee $o/tiles256_final.log
