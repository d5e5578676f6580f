#!/bin/bash
# Prepared for the next session's first call (not run): the Gluon dq prototype (gluon_dq.py)
# checked against a float32 reference (PyTorch's own bf16 error beside it), then timed against
# the library's Triton dq kernel (profiler, the same process) on the band of 2048
# (docs/bench/speed/s43/patterns/band2048.yaml: query m sees key n when n <= m < n + 2048,
# checked against the torch backend on the CPU) at 16K / 64K, on dense causal at 16K, and at
# head size 64. Configs BM,BN,HPP,STAGES,MODE: the base (128 x 64, 8 warps, mode 0), 128 keys a
# step, two GQA heads of 64 rows, mode 1 (the next tile's S / dP issued before the softmax
# terms), and 64 rows on 4 warps at 2 stages (two programs an SM). All timed with delta from O
# (DELTA 1, as the library's dq kernel computes it); the last step checks the delta-read path
# and what computing delta costs. Every step under its own timeout (sum 385 s).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
P=docs/bench/speed/s45/gluon_dq.py
BASE="--cfg 128,64,1,3,0 --cfg 128,128,1,2,0 --cfg 64,64,2,3,0 --cfg 128,64,1,4,1 --cfg 64,64,2,4,1"
timeout 160 python $P $BASE --cfg 64,64,1,2,0 --seq 16384 65536 --window 2048 --delta 1 \
  --library 2>&1 | grep -v -i warn | tee $OUT/gluon_dq_band_d128.txt
timeout 70 python $P --cfg 128,64,1,3,0 --cfg 128,128,1,2,0 --cfg 128,64,1,4,1 \
  --cfg 64,64,2,3,0 --seq 16384 --window 16384 --delta 1 --library --no-check --rounds 1 2>&1 \
  | grep -v -i warn | tee $OUT/gluon_dq_dense16k_d128.txt
timeout 110 python $P --dim 64 --cfg 64,64,1,3,0 --cfg 128,64,1,3,0 --cfg 64,128,1,3,0 \
  --cfg 64,64,1,4,1 --cfg 128,64,1,4,1 --seq 65536 --window 2048 --delta 1 --library 2>&1 \
  | grep -v -i warn | tee $OUT/gluon_dq_band_d64.txt
timeout 45 python $P --cfg 128,64,1,3,0 --cfg 128,64,1,4,1 --seq 65536 --delta 0 1 --rounds 1 \
  2>&1 | grep -v -i warn | tee $OUT/gluon_dq_delta_d128.txt
