#!/bin/bash
# Device call 1 of session 35: decoding with per-head key ranges computed in the kernel, pipelined
# key loops in a cache's layout and more splits for a dense head (D79). Decode tests on the GPU,
# then 1B decoding interleaved with SDPA, this tree against the previous commit (.scratch/base);
# then the H100 rows: 135M training steps beside SDPA and host time per call.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
PYTHONPATH=$PWD timeout 150 python -m pytest -q -n 8 -p no:benchmark tests/test_decode.py \
  > $OUT/decode_tests.txt 2>&1; tail -1 $OUT/decode_tests.txt
PYTHONPATH=$PWD timeout 150 python -m pytest -q -n 8 -p no:benchmark -m gpu -k "decode or cache or generate" tests \
  > $OUT/gpu_decode_tests.txt 2>&1; tail -1 $OUT/gpu_decode_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/*tests.txt | head
echo "tests wall $(( $(date +%s) - t0 )) s"
S=docs/bench/speed/s19/scripts/interleave.py
PYTHONPATH=$PWD timeout 200 python $S 1b 4096,32768,131072,262144 10 new 2>&1 | grep -v Warn | tee $OUT/decode_1b.txt
PYTHONPATH=$PWD/.scratch/base timeout 100 python $S 1b 131072,262144 10 base 2>&1 | grep -v Warn | tee -a $OUT/decode_1b.txt
echo "decode wall $(( $(date +%s) - t0 )) s"
PYTHONPATH=$PWD timeout 100 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096,8192,16384 5 new \
  2>&1 | grep -v Warn | tee $OUT/step_135m.txt
for s in 4096 16384; do PYTHONPATH=$PWD timeout 40 python examples/benchmarks/host_overhead.py --seq $s 2>&1 | tail -4; done | tee $OUT/host.txt
echo "total wall $(( $(date +%s) - t0 )) s"
