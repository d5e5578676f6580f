#!/bin/bash
# Device calls 1 and 2 of session 31: the forward in few launches (1: one, slots, counters and
# tickets; 2: two, the union configs' then the covering one's, slots alone) on a GPU:
# a quick check of every shipped pattern against the reference, the op's forward and
# fwd+bwd beside the previous commit (.scratch/base), then the GPU suite.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python docs/bench/speed/s31/scripts/fwd_smoke.py 2>&1 | grep -v Warn | tee $OUT/fwd_smoke.txt
echo "smoke $(( $(date +%s) - t0 )) s"
for v in new base; do
  P=$PWD; [ $v = base ] && P=$PWD/.scratch/base
  echo "== $v"; PYTHONPATH=$P timeout 130 python examples/benchmarks/kernel_timing.py --no-check --seq 4096 65536 --dense --pattern default longnet_lm sliding_sparse --rep-ms 100 --csv $OUT/timing_$v.csv 2>&1 | grep -v -i warn
done | tee $OUT/timing.txt
echo "timing $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout $(( 570 - $(date +%s) + t0 )) python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite.txt 2>&1
tail -12 $OUT/gpu_suite.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite.txt | head
echo "total $(( $(date +%s) - t0 )) s"
