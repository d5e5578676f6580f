#!/bin/bash
# Device calls 1 and 2 of session 30 (call 1 stopped at a layer's relaunch: a grid of two sizes
# where Triton's launcher takes three; fixed, then run again as call 2). Decoding in the cache's
# own layout (no position tensors; one launcher, workspace and compiled kernel for every step of
# a generation): the decode tests on the GPU, then this tree ("new") against the previous commit
# ("base", .scratch/base): host µs of a step's first layer and the other layers (1B, 4K), and ms
# per token beside SDPA flash, both caches, with and without a dense head (1B at 4K / 32K, 135M
# at 4K / 32K).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py > $OUT/decode_tests_gpu_H200.txt 2>&1
tail -3 $OUT/decode_tests_gpu_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/decode_tests_gpu_H200.txt | head
echo "decode tests wall $(( $(date +%s) - t0 )) s"
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P timeout 60 python docs/bench/speed/s26/scripts/decode_layers.py 1b 4096 50 2>&1 | grep -E "^\|"
done > $OUT/decode_layers_1b_4k_H200.txt 2>&1
cat $OUT/decode_layers_1b_4k_H200.txt | grep -E "==|first layer|layer call \||DecodeLauncher|step ours|step sdpa"
for round in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P timeout 80 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 10 $v 2>&1 | grep -v Warn
  done
done | tee $OUT/ab_decode_1b_H200.txt
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 60 python docs/bench/speed/s19/scripts/interleave.py 135m 4096,32768 10 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_decode_135m_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
