#!/bin/bash
# Session 44, device call 3: the Gluon dk/dv prototype (gluon_dkdv.py: both schedules checked
# against PyTorch, then timed) beside the library's dk/dv on the same band (2048 keys) and on
# dense causal attention; then the 135M training step beside SDPA (run_call2.sh's first half).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 150 python docs/bench/speed/s44/gluon_dkdv.py --seq 16384 65536 --window 2048 --bm 32 64 2>&1 \
  | grep -v -i warn | tee $OUT/gluon_band.txt
timeout 60 python docs/bench/speed/s44/gluon_dkdv.py --seq 16384 --window 16384 --bm 32 64 2>&1 \
  | grep -v -i warn | grep "S=16384" | tee $OUT/gluon_dense.txt
timeout 90 python docs/bench/speed/s44/tiles.py \
  32/8/128:16384,65536@docs/bench/speed/s43/patterns/band2048.yaml 2>&1 | grep -v -i warn \
  | tee $OUT/library_band.txt
timeout 240 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 8 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_135m.txt
