#!/bin/bash
# Device call 2 of session 28: the attention calls' host time inside a 4K training step (SDPA and
# ours, two rounds), then the step's host profile with our functions' cumulative times.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python docs/bench/speed/s28/scripts/step_insitu.py 135m 4096 8 2 2>&1 | grep -v Warn | tee $OUT/step_insitu_4k.txt
python docs/bench/speed/s28/scripts/step_profile.py 135m 4096 6 > $OUT/step_profile_cum_4k.txt 2>&1
grep -A60 "cumulative time" $OUT/step_profile_cum_4k.txt | cut -c1-160 | head -60
