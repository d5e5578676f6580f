#!/bin/bash
# Device call 2 of session 33: 135M training steps interleaved with SDPA's (same weights) at 4K
# and 16K, new then base, then 1B decoding ms per token ÷ SDPA flash at 4K, new then base.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 200 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 6 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_step_135m_H200.txt
echo "steps wall $(( $(date +%s) - t0 )) s"
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P timeout 80 python docs/bench/speed/s19/scripts/interleave.py 1b 4096 10 $v 2>&1 | grep -v Warn
done | tee $OUT/ab_decode_1b_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
