#!/bin/bash
# Prepared for the next session's first call (not run): the whole GPU suite cold on the tree
# with the Gluon dk/dv kernel (D92 ran only its own tests, test_modes and sinks_and_sliding on
# it), then the kernel at 64 queries a step (GLUON_BM=64: 160 bytes of spills on sm_90) against
# the library's 32 and the Triton kernel, at 16K / 64K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 240 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=0 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
T=docs/bench/speed/s44/tiles.py
timeout 120 python $T 32/8/128:16384,65536 32/8/128:65536@docs/bench/speed/s43/patterns/band2048.yaml \
  --tile "triton dkdv=dkdv:32,128,8,2" 2>&1 | grep -v -i warn | tee $OUT/gluon32_vs_triton.txt
GLUON_BM=64 timeout 90 python $T 32/8/128:16384,65536 \
  32/8/128:65536@docs/bench/speed/s43/patterns/band2048.yaml 2>&1 | grep -v -i warn \
  | tee $OUT/gluon64.txt
