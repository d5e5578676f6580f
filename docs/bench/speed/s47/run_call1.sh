#!/bin/bash
# Session 47, call 1 (on a tree with docs/bench/speed/s46/dkdv_earlier.diff applied): the GPU
# suite cold; the Gluon dk/dv kernel on launches with earlier configs against the Triton one
# (earlier.py, one process); the 135M step beside SDPA (stepinter.py) and 1B decoding beside
# SDPA (interleave.py) on this tree (session 46's host-side simplification was never timed).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 200 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider \
  --durations=40 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head -20
timeout 130 python docs/bench/speed/s46/earlier.py 32/8/128:65536@pow2 32/8/128:65536@longnet_lm \
  32/8/64:65536@longnet_lm 2>&1 | grep -v -i warn | tee $OUT/earlier.txt
timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 8 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_135m.txt
timeout 120 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 8 2>&1 \
  | grep -v -i warn | tee $OUT/interleave_1b.txt
