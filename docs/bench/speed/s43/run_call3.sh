#!/bin/bash
# Session 43, call 3: garbage collection in a 4K training step, ours against SDPA.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
PYTHONPATH=$PWD timeout 200 python docs/bench/speed/s43/step_gc.py 4096 6 2>&1 | grep -v -i warn \
  | tee $OUT/step_gc_4k.txt
