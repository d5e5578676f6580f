#!/bin/bash
# Session 25, one GPU: this commit's launch path ("new") against the previous commit ("base":
# .scratch/base, `git archive HEAD~ hf_hilbert_attn`, carried): the kernel and decode GPU tests,
# then host µs per attention call (135M heads, 4K), twice each in turn.
o=${OUT:-/tmp/out}; mkdir -p $o
nvidia-smi -L | tee $o/gpu.txt
PYTHONPATH=$PWD timeout 300 python -m pytest -q -m gpu -n 8 -p no:benchmark tests/test_kernels_gpu.py \
  tests/test_decode.py tests/test_host_path.py 2>&1 | tail -4 | tee $o/gpu_tests.log
bash docs/bench/speed/s25/host_ab.sh $o/host_ab.log 2
