#!/bin/bash
# Device call 3 of session 31: the backward's delta computed in the dq launches (one launch
# fewer per backward) and the attention function casting once under autocast: the GPU suite,
# then the op's fwd and fwd+bwd, this tree ("new") against the previous commit ("base",
# .scratch/base). Call 4 (run_call4.sh) follows at once, on the same machine.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 330 python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=5 tests > $OUT/gpu_suite.txt 2>&1
tail -4 $OUT/gpu_suite.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite.txt | head
echo "suite $(( $(date +%s) - t0 )) s"
for v in new base; do
  P=$PWD; [ $v = base ] && P=$PWD/.scratch/base
  echo "== $v"; PYTHONPATH=$P timeout 100 python examples/benchmarks/kernel_timing.py --no-check --seq 4096 65536 --pattern default sliding_sparse --rep-ms 100 --csv $OUT/timing_$v.csv 2>&1 | grep -v -i warn
done | tee $OUT/timing.txt
echo "total $(( $(date +%s) - t0 )) s"
