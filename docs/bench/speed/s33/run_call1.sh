#!/bin/bash
# Device call 1 of session 33: the GPU suite on the new tree (one prepared call per route, the
# kernels laid out one file per kernel), then the op's host time per call, new against base
# (the previous session's commit, .scratch/base): the default pattern at 8K (the kernels'
# prepared call) and with dense kv head 0 at 16K (dense heads split off to SDPA).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 330 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite_H200.txt 2>&1
tail -9 $OUT/gpu_suite_H200.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_H200.txt | head
echo "gpu suite wall $(( $(date +%s) - t0 )) s"
for args in "--seq 8192" "--seq 16384 --pattern configs/patterns/default_kv0_dense.yaml"; do
  for v in new base new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    echo "== $v $args"
    PYTHONPATH=$P timeout 60 python examples/benchmarks/host_overhead.py $args 2>&1 | tail -3
  done
done | tee $OUT/host_overhead_H200.txt
echo "total wall $(( $(date +%s) - t0 )) s"
