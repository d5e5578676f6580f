#!/bin/bash
# Device call 3: host µs per piece of a training call, this tree beside the previous commit
# (.scratch/base), three times in turn (run_ab1.sh's host rows failed on this tree: the script's
# stand-in for _run took the old arguments).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2 3; do
  for v in new base; do
    if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
    echo "== $v run $r"
    PYTHONPATH=$P python docs/bench/speed/s27/scripts/host_parts.py 4096 100 2>&1 | grep "^|" | grep -v "piece\|---" | head -13
  done
done
