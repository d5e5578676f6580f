#!/bin/bash
# Device call 5 of session 31 (right after call 4): the 135M training step at 4K again, under
# bf16 autocast with float32 weights and with bf16 weights (no autocast), new then base.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
for v in new base; do P=$PWD; [ $v = base ] && P=$PWD/.scratch/base
  PYTHONPATH=$P timeout 60 python docs/bench/speed/s31/scripts/step_autocast.py 135m 4096 6 $v 2>&1 | grep -v -i warn
  PYTHONPATH=$P timeout 50 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 6 $v-bf16 2>&1 | grep -v -i warn
done | tee $OUT/steps_again.txt
