#!/bin/bash
# Device call 3 of session 30: where a decode step's host time goes, ours beside SDPA flash,
# inside the steps (1B and 135M at 4K; the tree of call 2).
export PYTHONPATH=$PWD
for s in 1b 135m; do
  timeout 120 python docs/bench/speed/s30/scripts/decode_insitu.py $s 4096 30 2>&1 | grep -v -i warn
done | tee $OUT/decode_insitu_4k_H200.txt
