#!/bin/bash
# Session 48, call 1: the Gluon forward prototype and the Triton forward probe against our
# library's dense forward and SDPA, one process each (issue 34).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 300 python docs/bench/speed/s48/gluon_fwd.py --seq 4096 16384 65536 --dims 128 64 2>&1 \
  | grep -v -i warn | tee $OUT/call1_gluon_fwd.txt
timeout 150 python docs/bench/speed/s48/fwd_probe.py --seq 16384 65536 --dims 128 2>&1 \
  | grep -v -i warn | tee $OUT/call1_fwd_probe.txt
