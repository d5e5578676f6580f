#!/bin/bash
# Device call 2 of session 35: where a training call's host time goes (ours beside SDPA flash,
# the 135M attention shape; host_overhead.py's layers), then 1B decoding at 1M tokens of context.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc2
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 90 python docs/bench/speed/s35/bwd_host.py 4096 > $OUT/bwd_host_4k.txt 2>&1
head -4 $OUT/bwd_host_4k.txt
PYTHONPATH=$PWD timeout 60 python examples/benchmarks/host_overhead.py --seq 4096 --layers 2>&1 | tail -16 | tee $OUT/host_layers_4k.txt
PYTHONPATH=$PWD timeout 300 python docs/bench/speed/s35/decode_long.py 1048576 10 2>&1 | grep -v Warn | tee $OUT/decode_1m.txt
echo "total wall $(( $(date +%s) - t0 )) s"
