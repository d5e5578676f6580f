#!/bin/bash
# Session 24 (issue 35, soft-capped scores, D66), one GPU: the GPU suite on a cold Triton cache
# (the kernels changed), then warm; the decode kernel's and the Gemma 2 tests on the GPU.
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
nvidia-smi -L | tee $o/gpu.txt
for run in cold warm; do
  echo "=== GPU suite, $run Triton cache" | tee -a $o/gpu_suite.log
  timeout 300 python -m pytest -q -m gpu -n 16 tests -p no:benchmark --durations=6 2>&1 \
    | tail -14 | tee -a $o/gpu_suite.log
done
timeout 200 python -m pytest -q -n 8 tests/test_decode.py tests/test_softcap.py -p no:benchmark \
  2>&1 | tail -6 | tee $o/decode_softcap_tests.log
