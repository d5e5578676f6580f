#!/bin/bash
# Session 25, one GPU: the hot path, this commit ("new") and the previous one ("base",
# .scratch/base carried) in turn: a 135M training step at 4K beside SDPA (interleaved in each
# process), then 1B decoding at 4K / 32K beside SDPA flash.
o=${OUT:-/tmp/out}; mkdir -p $o
nvidia-smi -L | tee $o/gpu.txt
for r in 1 2; do
  for tag in new base; do
    pkg=$PWD; [ $tag = base ] && pkg=$PWD/.scratch/base
    PYTHONPATH=$pkg:$PWD timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 \
      "$tag-r$r" 2>&1 | grep -v arn | tail -1 | tee -a $o/step_ab.log
  done
done
for tag in new base; do
  pkg=$PWD; [ $tag = base ] && pkg=$PWD/.scratch/base
  PYTHONPATH=$pkg:$PWD timeout 150 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 \
    $tag 2>&1 | grep -v arn | grep ctx= | tee -a $o/decode_ab.log
done
