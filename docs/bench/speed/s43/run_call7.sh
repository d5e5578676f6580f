#!/bin/bash
# Session 43, call 7 (carry .scratch/v43): the sliding launches' forward without union code
# (the band of `default` and `sliding_sparse`) with its window-edge tiles in the loop of whole
# tiles (varA), or every tile in one masked loop (varB), against the library (head); per config
# at 64K, Hq 32 / Hkv 8, D 128, bf16, packages in turn, twice.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc7
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
for tag in head varA varB head2 varA2 varB2; do
  echo "=== $tag" | tee -a $OUT/profile_band.txt
  PYTHONPATH=$PWD/.scratch/v43/${tag%2} timeout 90 python examples/benchmarks/kernel_timing.py \
    --no-check --seq 65536 --profile --pattern default sliding_sparse --rep-ms 200 \
    2>&1 | grep -v -i warn | grep -E "^\| \(|^ours|^===" | tee -a $OUT/profile_band.txt
done
