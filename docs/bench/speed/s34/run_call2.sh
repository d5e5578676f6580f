#!/bin/bash
# Device call 2 of session 34: the union launches' two key ranges through one copy of the tile
# loops (forward, dq). The GPU suite from a cold Triton cache with every compile logged, then the
# op's timing, this tree against the previous commit (.scratch/base), every shipped pattern that
# launches union code (longnet_lm, pow2) and the default / sliding_sparse beside them.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc2 COMPILE_LOG=$OUT/compiles.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD:$PWD/docs/bench/speed/s34 timeout 300 python -m pytest -q -m gpu -n 16 -p no:benchmark \
  -p compile_log --durations=15 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -18 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
echo "cold suite wall $(( $(date +%s) - t0 )) s"
for v in base new; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  echo "== $v"
  PYTHONPATH=$P timeout 200 python examples/benchmarks/kernel_timing.py --no-check --seq 4096 65536 \
    --pattern default longnet_lm pow2 sliding_sparse --csv $OUT/timing_$v.csv 2>&1 | grep -E "^ours"
done | tee $OUT/timing_ab.txt
echo "total wall $(( $(date +%s) - t0 )) s"
