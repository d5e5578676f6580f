#!/bin/bash
# Session 44, device call 6: the Gluon dk/dv kernel with its masks only on edge tiles and its
# lse / delta rows stepped (fewer instructions a step): its GPU tests, then against the
# Triton dk/dv kernel on the band alone and on default at 64K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 100 python -m pytest -q -n 12 -p no:cacheprovider tests/test_kernels_gpu.py -k \
  "hopper or test_modes or sinks_and_sliding" > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head
timeout 80 python docs/bench/speed/s44/tiles.py \
  32/8/128:65536@docs/bench/speed/s43/patterns/band2048.yaml 32/8/128:65536 \
  --tile "triton dkdv=dkdv:32,128,8,2" 2>&1 | grep -v -i warn | tee $OUT/gluon_vs_triton.txt
