#!/bin/bash
# Session 44, device call 4: the Gluon dk/dv kernel in the library (kernels/_dkdv_wgmma.py):
# its GPU tests and the tests whose launches it takes, then the library (Gluon dk/dv) against
# the Triton dk/dv kernel (a dk/dv tile override turns Gluon off) per kernel, at 16K / 64K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 230 python -m pytest -q -n 12 -p no:cacheprovider tests/test_kernels_gpu.py -k \
  "hopper or longnet_like or test_modes or sinks_and_sliding or sliding_modes or dense_heads" \
  > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests.txt | head -20
T=docs/bench/speed/s44/tiles.py
timeout 150 python $T 32/8/128:16384,65536 32/8/128:65536@longnet_lm 32/8/128:65536@pow2 \
  32/8/128:65536@sliding_sparse --tile "triton dkdv=dkdv:32,128,8,2" 2>&1 | grep -v -i warn \
  | tee $OUT/gluon_vs_triton.txt
GLUON_BM=64 timeout 60 python $T 32/8/128:65536 2>&1 | grep -v -i warn | tee $OUT/gluon_bm64.txt
