#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
/usr/bin/time -f "gpu suite wall %e s" python -m pytest -q -m gpu -n 16 tests --durations=8 -p no:cacheprovider > $OUT/gpu_suite.log 2>&1; tail -12 $OUT/gpu_suite.log
python examples/benchmarks/kernel_timing.py --seq 16384 65536 --hq 8 --hkv 4 --dim 256 --pattern default longnet_lm --dense --csv $OUT/timing_d256_H200.csv > $OUT/timing_d256.log 2>&1; tail -30 $OUT/timing_d256.log
