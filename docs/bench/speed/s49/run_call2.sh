#!/bin/bash
# Session 49, call 2 (about 430 s on an H100), on the tree with the hoisted key addresses
# (D99): the README's attention table re-measured (16K / 64K / 128K, every shipped pattern, per
# config and kernel), the 135M step beside SDPA at 4K / 16K, 1B decoding beside SDPA's flash
# backend (both caches, with and without dense head 0) at 4K / 32K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 200 python examples/benchmarks/kernel_timing.py --no-check --seq 16384 65536 131072 \
  --dense --profile --pattern longnet_lm pow2 default sliding_sparse 2>&1 | grep -v -i warn \
  > $OUT/kernel_timing_d128.txt; grep -E "^(ours|sdpa|÷)" $OUT/kernel_timing_d128.txt
timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 8 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_135m.txt
timeout 120 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 8 2>&1 \
  | grep -v -i warn | tee $OUT/interleave_1b.txt
