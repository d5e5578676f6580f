#!/bin/bash
# Device call 7 of session 29: backward tiles at head size 128 on short and long sequences
# (data for the next session; the defaults at head size 128 are unchanged).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
VARIANTS="base,d128" timeout 170 python docs/bench/speed/s29/scripts/small_tiles.py \
  32/8/128:4096,16384,65536 2>&1 | grep -v Warn | tee $OUT/tiles_d128_H200.txt
