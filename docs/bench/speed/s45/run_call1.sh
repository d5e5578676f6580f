#!/bin/bash
# Session 45, device call 1: the whole GPU suite cold on the tree (the Gluon dk/dv kernel with
# its lse / delta through shared memory, at head size 128 and 64); then the kernel against the
# Triton dk/dv kernel in one process: head size 128 with 32 and 64 queries a step (band, default,
# 64K, 32 / 8 heads), head size 64 (the 135M shapes 9 / 3 at 4K / 16K, the 1B one 32 / 8 at 64K;
# the Triton tile there 16 x 64, 4 warps, 3 stages).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 200 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=0 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
T=docs/bench/speed/s44/tiles.py
B=docs/bench/speed/s43/patterns/band2048.yaml
for bm in 32 64; do
  GLUON_BM=$bm timeout 100 python $T 32/8/128:65536@$B 32/8/128:65536 \
    --tile "triton dkdv=dkdv:32,128,8,2" 2>&1 | grep -v -i warn | tee $OUT/gluon${bm}_d128.txt
done
timeout 120 python $T 9/3/64:4096,16384 32/8/64:65536 --tile "triton dkdv=dkdv:16,64,4,3" 2>&1 \
  | grep -v -i warn | tee $OUT/gluon32_d64.txt
