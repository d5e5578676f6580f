#!/bin/bash
# Session 25, one GPU, the final launch code: the GPU test suite (Triton cache cold), host µs
# per call against the previous commit (.scratch/base carried), 1B decoding beside SDPA flash.
o=${OUT:-/tmp/out}; mkdir -p $o
nvidia-smi -L | tee $o/gpu.txt
export PYTHONPATH=$PWD
( time timeout 400 python -m pytest -q -m gpu -n 16 -p no:benchmark tests ) 2>&1 | tail -6 \
  | tee $o/gpu_suite.log
bash docs/bench/speed/s25/host_ab.sh $o/host_final.log 1
timeout 120 python examples/benchmarks/host_overhead.py --seq 4096 --layers 2>&1 | grep "^|" \
  | tee $o/host_layers_new.txt
timeout 150 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 final 2>&1 \
  | grep ctx= | tee $o/decode_final.log
