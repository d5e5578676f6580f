#!/bin/bash
# Session 23, final code, one H200: the hot path beside SDPA (the 135M step at 4K, interleaved; 1B
# decoding at 4K / 32K: DynamicCache, PatternCache, a dense kv head), then the GPU test suite.
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
nvidia-smi -L | tee $o/gpu.txt
timeout 150 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 s23 2>&1 | grep -v arn | tail -5 | tee $o/step_interleaved_135m_H200.log
timeout 170 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 s23 2>&1 | grep -v arn | tail -25 | tee $o/decode_interleaved_1b_H200.log
timeout 200 python -m pytest -q -m gpu -n 16 tests --durations=8 2>&1 | tail -15 | tee $o/gpu_suite_H200.log
