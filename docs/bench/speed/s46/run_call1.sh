#!/bin/bash
# Session 46, device call 1: the GPU suite cold with every compile logged (conftest's
# HF_HILBERT_TEST_TIMELINE: which kernels it compiles, how long each takes, which workers
# compiled alike), with the Gluon dq kernel (kernels/_dq_wgmma.py) in the plan; then the library
# with and without it (tiles.py "off:dq": the Triton dq kernel on the library's tiles) on the
# shipped patterns at 64K (32 / 8 heads, D 128), at head size 64 (135M 9 / 3 at 4K / 16K, 1B
# 32 / 8 at 64K); then session 45's prototype (gluon_dq.py) on the band at 64K: its schedules
# the library kernel lacks (mode 1, two GQA heads a program).
# The tree it ran on: commit 7df1378 with gluon_dq_tree.diff applied, and a compile listener in
# tests/conftest.py that appended `compile NAME HASH MS miss|hit` to each worker's timeline (not
# kept: session 43's plugin does the same, `-p compile_log` with docs/bench/speed/s43 on
# PYTHONPATH and COMPILE_LOG=DIR).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
HF_HILBERT_TEST_TIMELINE=/tmp/tl timeout 180 python -m pytest -q -m gpu -n 16 -p no:benchmark \
  -p no:cacheprovider --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_suite_cold.txt | head -20
tar czf $OUT/timeline.tgz -C /tmp tl
T=docs/bench/speed/s44/tiles.py
B=docs/bench/speed/s43/patterns/band2048.yaml
timeout 150 python $T 32/8/128:65536@$B 32/8/128:65536 32/8/128:65536@pow2 \
  32/8/128:65536@longnet_lm 32/8/128:65536@sliding_sparse --tile "triton dq=off:dq" 2>&1 \
  | grep -v -i warn | tee $OUT/dq_d128.txt
timeout 90 python $T 9/3/64:4096,16384 32/8/64:65536 --tile "triton dq=off:dq" 2>&1 \
  | grep -v -i warn | tee $OUT/dq_d64.txt
timeout 80 python docs/bench/speed/s45/gluon_dq.py --cfg 128,64,1,3,0 --cfg 128,64,1,4,1 \
  --cfg 64,64,2,3,0 --cfg 64,64,2,4,1 --seq 65536 --window 2048 --delta 1 --no-check 2>&1 \
  | grep -v -i warn | tee $OUT/proto_band.txt
