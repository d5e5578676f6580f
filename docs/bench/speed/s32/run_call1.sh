#!/bin/bash
# Device call 1 of session 32: a decode step's later layers run its first layer's prepared call
# (decode.PreparedDecode). The decode tests on the GPU, then this tree ("new") against the
# previous commit ("base", .scratch/base): our attention and mask functions inside interleaved
# decode steps (1B, 4K), and ms per token beside SDPA flash (1B and 135M, 4K / 32K, both caches,
# with and without a dense head). Keeps the GGUF's first half in /tmp/hfa for call 2.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/hfa && cp .scratch/a1/* /tmp/hfa/
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py > $OUT/decode_tests_gpu_H200.txt 2>&1
tail -2 $OUT/decode_tests_gpu_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/decode_tests_gpu_H200.txt | head
echo "decode tests wall $(( $(date +%s) - t0 )) s"
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"; PYTHONPATH=$P timeout 70 python docs/bench/speed/s30/scripts/decode_insitu.py 1b 4096 20 2>&1 | grep -v -i warn
done | tee $OUT/decode_insitu_1b_4k_H200.txt | grep -E "==|attn|step"
for s in 1b 135m; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P timeout 90 python docs/bench/speed/s19/scripts/interleave.py $s 4096,32768 10 $v 2>&1 | grep -v Warn
  done
done | tee $OUT/ab_decode_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
