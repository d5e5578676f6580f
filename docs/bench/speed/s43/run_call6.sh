#!/bin/bash
# Session 43, call 6: the GPU suite from a cold Triton cache with every compile logged
# (compile_log.py), to see where its time goes.
export PYTHONUNBUFFERED=1
rm -rf /tmp/tc_cold /tmp/clog
COMPILE_LOG=/tmp/clog TRITON_CACHE_DIR=/tmp/tc_cold PYTHONPATH=$PWD/docs/bench/speed/s43 \
  timeout 300 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider -p compile_log \
  --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -3 $OUT/gpu_suite_cold.txt
cat /tmp/clog/*.jsonl > $OUT/compile_log.jsonl; wc -l $OUT/compile_log.jsonl
