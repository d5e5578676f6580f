#!/bin/bash
# Session 44, device call 2: the rows session 43 could not re-measure after D90 (the backward's
# float32 sums as views): the 135M training step interleaved with SDPA's at 4K / 16K, and 1B
# decoding against SDPA (as Transformers calls it and its flash backend) at 4K / 32K.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 280 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 8 run1 2>&1 \
  | grep -v -i warn | tee $OUT/stepinter_135m.txt
timeout 280 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 8 2>&1 \
  | grep -v -i warn | tee $OUT/interleave_1b.txt
