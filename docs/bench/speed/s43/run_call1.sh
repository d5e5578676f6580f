#!/bin/bash
# Session 43, call 1 (carry .scratch/head and .scratch/pairq, made by s42/make_packages.sh):
# session 42's prepared dq pair tile (its GPU tests and longnet_lm's per-config profile, head
# and pairq in turn, twice), then the host time per layer of one call at 4K on this tree.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-300} bash docs/bench/speed/s42/run_next.sh
PYTHONPATH=$PWD timeout 90 python examples/benchmarks/host_overhead.py --seq 4096 --layers \
  2>&1 | grep -v -i warn | tail -20 | tee $OUT/host_layers_4k.txt
