#!/bin/bash
# Device run: decode relaunch path (D68) - GPU tests, launch costs, decoding beside SDPA for the
# new code and the previous commit (.scratch/base), in one call.
export NCCL_NVLS_ENABLE=0
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py tests/test_host_path.py 2>&1 | tail -3
python -m pytest -q -m gpu -n 8 -p no:benchmark tests/test_kernels_gpu.py -k "decode or relaunch" 2>&1 | tail -3
python docs/bench/speed/s26/scripts/launch_floor.py 4096 2>&1 | grep "^|\|arguments"
for r in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    PYTHONPATH=$P python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 "$v" 2>&1 | grep ctx=
  done
done
