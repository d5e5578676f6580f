#!/bin/bash
# Device call 2: the call-level launch memo (this tree) beside the previous commit
# (.scratch/base): host µs per piece of a training call, the 135M step at 4K, twice each, in turn.
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    echo "== $v run $r"
    PYTHONPATH=$P python docs/bench/speed/s27/scripts/host_parts.py 4096 100 2>&1 | grep "^|" | grep -v "piece\|---"
  done
done
bash docs/bench/speed/s27/step_ab.sh
