#!/bin/bash
# Prepared in session 46, not run (four tries got no machine): on a tree with
# docs/bench/speed/s46/dkdv_earlier.diff applied (`git apply` it first, on this machine), the GPU
# suite cold with the Gluon dk/dv kernel on launches with earlier configs that need no per-pair
# union mask (docs/bench/speed/s46/README.md), then that kernel against the Triton one on those launches in one process
# (earlier.py: pow2 and longnet_lm at 64K, 32 / 8 heads, D 128; longnet_lm at D 64 too). About
# 280 s: the next session's first call.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 180 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider \
  --durations=30 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head -20
timeout 100 python docs/bench/speed/s46/earlier.py 32/8/128:65536@pow2 32/8/128:65536@longnet_lm \
  32/8/64:65536@longnet_lm 2>&1 | grep -v -i warn | tee $OUT/earlier.txt
