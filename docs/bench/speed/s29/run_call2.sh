#!/bin/bash
# Device call 2 of session 29: GPU tests of the changed kernels and launcher, then this tree
# ("new") against the previous commit ("base", .scratch/base) in turn: the 135M step at 4K and
# 8K beside SDPA, the attention's host time inside the step, then the tile search again (the
# first run's overrides never reached the prepared calls: the bug this tree fixes).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 280 python -m pytest -q -n 16 -p no:benchmark tests/test_kernels_gpu.py tests/test_dense_heads_gpu.py \
  tests/test_learned_sinks.py tests/test_host_path.py tests/test_decode.py > $OUT/gpu_tests_H200.txt 2>&1
tail -3 $OUT/gpu_tests_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_H200.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
for r in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,8192 8 "$v-r$r" 2>&1 | grep 135m
  done
done | tee $OUT/ab_step_H200.txt
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P timeout 60 python docs/bench/speed/s28/scripts/step_insitu.py 135m 4096 6 1 2>&1 | grep -v Warn
done | tee $OUT/ab_insitu_H200.txt
echo "ab wall $(( $(date +%s) - t0 )) s"
timeout 150 python docs/bench/speed/s29/scripts/small_tiles.py 32/8/64:4096,16384 9/3/64:16384 2>&1 | grep -v Warn \
  | tee $OUT/small_tiles_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
