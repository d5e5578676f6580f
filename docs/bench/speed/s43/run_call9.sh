#!/bin/bash
# Session 43, call 9 (carry .scratch/v43: head = 3dfc73d): the GPU suite from a cold Triton
# cache on the tree (the backward's float32 sums as as_strided views), then host µs per
# attention call at 4K (135M heads), head and tree in turn, twice.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 240 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=0 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -2 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
for tag in head tree head2 tree2; do
  p=$PWD; [ ${tag%2} = head ] && p=$PWD/.scratch/v43/head
  echo "=== $tag" | tee -a $OUT/host_4k.txt
  PYTHONPATH=$p timeout 60 python examples/benchmarks/host_overhead.py --seq 4096 --repeats 10 \
    2>&1 | grep "^|" | tee -a $OUT/host_4k.txt
done
