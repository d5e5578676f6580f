#!/bin/bash
# Session 43, call 2: where a 4K training step's host time goes, ours against SDPA (cProfile of
# a 135M-shaped step each, in one process), and the step ratio interleaved.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
PYTHONPATH=$PWD timeout 200 python docs/bench/speed/s43/step_profile.py 4096 5 $OUT 2>&1 \
  | grep -v -i warn | tee $OUT/step_profile_diff_4k.txt
PYTHONPATH=$PWD timeout 150 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 5 head \
  2>&1 | grep -v -i warn | tee $OUT/stepinter_4k.txt
