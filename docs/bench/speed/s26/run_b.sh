#!/bin/bash
# Device run, final code (D68): the GPU suite, the decode tests on the GPU, decoding beside
# SDPA (new code and the previous commit, .scratch/base), the 135M decode and training step.
export NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
python -m pytest -q -m gpu -n 16 -p no:benchmark tests 2>&1 | tail -3
echo "gpu suite: $(( $(date +%s) - start )) s"
python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py 2>&1 | tail -2
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 "$v" 2>&1 | grep ctx=
done
python docs/bench/speed/s19/scripts/interleave.py 135m 4096,32768 20 new 2>&1 | grep ctx=
python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 new 2>&1 | grep 135m
