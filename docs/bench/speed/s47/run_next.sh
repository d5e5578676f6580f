#!/bin/bash
# Prepared in session 47 for the next session's first call (about 250 s): the README's attention
# table after D96 (its longnet_lm row predates it), and the 1B step at 64K beside SDPA with and
# without dense head 0 (issue 38's row; D95 / D96 do not touch `default`, so a check, not a claim).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 200 python examples/benchmarks/kernel_timing.py --no-check --seq 16384 65536 131072 \
  --dense --profile --pattern longnet_lm pow2 default sliding_sparse 2>&1 | grep -v -i warn \
  > $OUT/kernel_timing_d128.txt; grep -E "^(ours|sdpa|÷)" $OUT/kernel_timing_d128.txt
timeout 150 python docs/bench/speed/s20/scripts/stepinter.py 1b 65536 4 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_1b_64k.txt
