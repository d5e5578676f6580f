#!/bin/bash
# Device call 3 of session 29: the backward tiles at head size 64 on long sequences (64K, every
# shipped sparse pattern) before changing the defaults for head size 64.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
VARIANTS="base,dkdv 16,dkdv 32,dq 64x64,both" timeout 400 python docs/bench/speed/s29/scripts/small_tiles.py \
  32/8/64:65536 32/8/64:65536@longnet_lm 32/8/64:65536@sliding_sparse 2>&1 | grep -v Warn \
  | tee $OUT/tiles_64k_d64_H200.txt
