#!/bin/bash
# Session 45, device call 2: the Gluon dk/dv kernel at 64 queries a step (the library's now):
# its GPU tests and the compile-together one; whether its calls relaunch on the fast path (host
# µs at 4K); against the Triton kernel at head size 64 (64 a step; call 1 had 32) and on the
# other shipped patterns at 64K; the 135M training step interleaved with SDPA's at 4K / 16K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 140 python -m pytest -q -n 16 -p no:benchmark -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "hopper or test_modes or sinks_and_sliding or first_call or head_dim_64" > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt
timeout 45 python docs/bench/speed/s45/fast_path.py 2>&1 | grep -v -i warn | tee $OUT/fast_path.txt
T=docs/bench/speed/s44/tiles.py
timeout 60 python $T 9/3/64:4096,16384 32/8/64:65536 --tile "triton dkdv=dkdv:16,64,4,3" 2>&1 \
  | grep -v -i warn | tee $OUT/gluon64_d64.txt
timeout 90 python $T 32/8/128:65536@pow2 32/8/128:65536@longnet_lm \
  32/8/128:65536@sliding_sparse --tile "triton dkdv=dkdv:32,128,8,2" 2>&1 | grep -v -i warn \
  | tee $OUT/gluon64_d128_patterns.txt
timeout 220 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 8 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_135m.txt
