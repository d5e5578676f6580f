#!/bin/bash
# Session 24, one GPU: head size 256 (Gemma) tiles. The forward, dq and dk/dv tiles of D58
# (32 x 32, 8 warps; dk/dv 16 x 32) against larger ones, set through the kernels' environment
# overrides (BM,BN,warps,stages; dk/dv: queries per step, keys per program), per config and
# kernel (--profile), our kernels on the dense pattern (--dense) and the default pattern, 32K,
# 16 / 8 heads.
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
T="python examples/benchmarks/kernel_timing.py --no-check --pattern default --dense --seq 32768 \
  --hq 16 --hkv 8 --dim 256 --profile --rep-ms 100"
v() {  # tag fwd dq dkdv
  echo "=== $1 fwd=$2 dq=$3 dkdv=$4 $(date +%T)" | tee -a $o/tiles256.log
  HF_HILBERT_FWD1_BLOCKS=$2 HF_HILBERT_FWD_BLOCKS=$2 HF_HILBERT_DQ_BLOCKS=$3 \
    HF_HILBERT_DKDV_BLOCKS=$4 timeout 150 $T 2>&1 | grep -v "Warn\|warn" | tail -40 \
    | tee -a $o/tiles256.log
}
v d58 32,32,8,2 32,32,8,2 16,32,8,2
v a 64,32,4,2 64,32,4,2 32,32,4,2
v b 64,64,4,2 64,64,8,2 32,64,8,2
v c 128,64,8,2 128,32,8,2 32,64,8,2
v d 64,64,8,2 64,32,8,2 16,64,8,2
