#!/bin/bash
# Prepared for the next device call (make_packages.sh first; carry .scratch/head and
# .scratch/pairq; BUDGET seconds, default 300). 1. Correctness of pairq's dq tile: the GPU
# tests whose patterns have launches with the per-pair union test (LONGNET_SMALL's rates 6 and
# 12), on pairq (PYTHONSAFEPATH=1: pytest imports the carried package, not the checkout's).
# 2. Per config and kernel at 64K and 128K, longnet_lm (Hq 32 / Hkv 8, D 128, bf16), head and
# pairq in turn, twice: only the (16384, 6) and (32768, 12) dq launches should move.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1
B=${BUDGET:-300}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
left() { echo $(( B - $1 - $(date +%s) + t0 )); }
PYTHONSAFEPATH=1 PYTHONPATH=$PWD/.scratch/pairq timeout 120 python -m pytest -q -m gpu -n 8 \
  -p no:benchmark -p no:cacheprovider tests/test_kernels_gpu.py \
  -k "longnet_like or offset_runs or lse_gradient or relaunch or views or autocast" \
  > $OUT/pairq_tests.txt 2>&1
tail -1 $OUT/pairq_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/pairq_tests.txt
for tag in head pairq head2 pairq2; do
  lim=$(left 5); [ $lim -gt 30 ] || break; [ $lim -gt 80 ] && lim=80
  echo "=== $tag" | tee -a $OUT/profile_longnet.txt
  PYTHONPATH=$PWD/.scratch/${tag%2} timeout $lim python examples/benchmarks/kernel_timing.py \
    --no-check --seq 65536 131072 --profile --pattern longnet_lm \
    2>&1 | grep -v -i warn | tee -a $OUT/profile_longnet.txt
done
echo "total wall $(( $(date +%s) - t0 )) s"
