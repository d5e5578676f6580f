#!/bin/bash
# Session 49, call 1 (about 520 s on an H100). Before it, on the CPU machine:
#   git apply docs/bench/speed/s48/key_tile_hoist.diff
#   mkdir -p ab_old && git archive HEAD hf_hilbert_attn | tar -x -C ab_old \
#     && mv ab_old/hf_hilbert_attn ab_old/hf_old          # (ab_old/ is not committed)
# session 48's run_next.sh (the hoisted key addresses against the committed package in one
# process, the per-kernel table with them, the first launch on 128-key tiles, the GPU suite
# cold), and sliding_sparse's and default's forward on 64 x 64 tiles / 4 warps (their launches
# all take 128 x 64 / 8 warps today: in sliding mode none has an earlier config).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 90 python docs/bench/speed/s48/ab_one.py --seq 65536 2>&1 | grep -v -i warn \
  | tee $OUT/ab_one.txt
timeout 110 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --profile --dense \
  --pattern longnet_lm default sliding_sparse pow2 2>&1 | grep -v -i warn > $OUT/kernel_timing.txt
grep -E "^(ours|÷)" $OUT/kernel_timing.txt
HF_HILBERT_FWD1_BLOCKS=128,128,8,3 timeout 60 python examples/benchmarks/kernel_timing.py \
  --no-check --seq 65536 --profile --dense --pattern default 2>&1 | grep -v -i warn \
  > $OUT/kernel_timing_fwd1_128x128.txt
grep -E "^(ours|÷)" $OUT/kernel_timing_fwd1_128x128.txt
HF_HILBERT_FWD_BLOCKS=64,64,4,3 timeout 70 python examples/benchmarks/kernel_timing.py \
  --no-check --seq 65536 --profile --dense --pattern sliding_sparse default 2>&1 \
  | grep -v -i warn > $OUT/kernel_timing_sliding_64x64.txt
grep -E "^(ours|÷)" $OUT/kernel_timing_sliding_64x64.txt
timeout 200 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=40 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
