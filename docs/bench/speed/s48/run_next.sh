#!/bin/bash
# Prepared in session 48 (the device was paused before it could run; about 390 s on an H100).
# Before the call, on the CPU machine:
#   git apply docs/bench/speed/s48/key_tile_hoist.diff
#   mkdir -p ab_old && git archive HEAD hf_hilbert_attn | tar -x -C ab_old \
#     && mv ab_old/hf_hilbert_attn ab_old/hf_old          # (ab_old/ is not committed)
# Then: the hoisted key addresses against the committed package in one process (dense forward,
# default fwd+bwd at 64K, outputs and gradients compared), the per-kernel table with the diff,
# the first launch on 128-key tiles, and the GPU suite cold with it (issue 34; D97's next step).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 90 python docs/bench/speed/s48/ab_one.py --seq 65536 2>&1 | grep -v -i warn \
  | tee $OUT/ab_one.txt
timeout 110 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --profile --dense \
  --pattern longnet_lm default sliding_sparse pow2 2>&1 | grep -v -i warn > $OUT/kernel_timing.txt
grep -E "^(ours|÷)" $OUT/kernel_timing.txt
# the first launch on 128-key tiles (the probe's 1.18-1.30x; spills 12 / 12 bytes on sm_90)
HF_HILBERT_FWD1_BLOCKS=128,128,8,3 timeout 60 python examples/benchmarks/kernel_timing.py \
  --no-check --seq 65536 --profile --dense --pattern default 2>&1 | grep -v -i warn \
  > $OUT/kernel_timing_fwd1_128x128.txt
grep -E "^(ours|÷)" $OUT/kernel_timing_fwd1_128x128.txt
timeout 200 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=40 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
