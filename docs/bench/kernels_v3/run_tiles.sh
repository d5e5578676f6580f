#!/bin/bash
# Session 23 (issue 34): tiles of the launches without union code (the first config and, since
# D64, the sliding band-edge launches), screened for sm_90 spills on the CPU first
# (kernel_resources.py --env ...): per-config, per-kernel profiles of the shipped sliding
# patterns and of single-band patterns (.scratch/*.yaml: [(2048, 1)] with 0 / 1 sink token,
# default without its sink token), current tiles and the alternatives, twice, one GPU.
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD
P="default sliding_sparse .scratch/default_nosink.yaml .scratch/band2048_s0.yaml .scratch/band2048_s1.yaml"
ALT="HF_HILBERT_FWD1_BLOCKS=128,32,8,3 HF_HILBERT_DQ_BLOCKS=128,32,8,3 HF_HILBERT_DKDV_BLOCKS=16,128,8,2"
for round in 1 2; do
  for v in cur alt; do
    echo "=== $v round $round $(date +%T)" | tee -a $o/tiles.log
    if [ $v = alt ]; then E="env $ALT"; else E=""; fi
    $E python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --profile --pattern $P \
      2>&1 | grep -v "Warn\|warn" | tee -a $o/tiles.log
  done
done
