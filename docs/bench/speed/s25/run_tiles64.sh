#!/bin/bash
# Session 25, one GPU: backward tiles at head size 64 (SmolLM2-135M heads, 9 / 3, 16K, default
# pattern), each variant in its own process through the tile overrides, with the small-shape
# check against the float32 reference; the current tiles first and last (the noise). Screened
# before on the CPU (kernel_resources.py, sm_90): 4-warp dk/dv tiles of 32 x 128 and 64 x 64 and
# 4-warp dq tiles of 128 keys' rows spill (400-1500 bytes per thread); these do not, or little.
o=${OUT:-/tmp/out}; mkdir -p $o
nvidia-smi -L | tee $o/gpu.txt
export PYTHONPATH=$PWD
run() {  # tag, env assignments...
  local tag=$1; shift
  echo "=== $tag $*" | tee -a $o/tiles64.log
  env "$@" timeout 90 python examples/benchmarks/kernel_timing.py --seq 16384 --hq 9 --hkv 3 \
    --dim 64 --pattern default --rep-ms 200 2>&1 | grep -v -i warn | tee -a $o/tiles64.log
}
run current
run dkdv_32x128_w8_s3 HF_HILBERT_DKDV_BLOCKS=32,128,8,3
run dkdv_32x64_w4_s3 HF_HILBERT_DKDV_BLOCKS=32,64,4,3
run dq_64x64_w4_s3 HF_HILBERT_DQ_BLOCKS=64,64,4,3
run current_again
