#!/bin/bash
# A second call, right after run_next.sh (the machine still warm: the same host, so the two cold
# suites compare): the GPU suite cold again (a fresh Triton and Inductor cache) with one compile
# thread per xdist worker for our kernels and for Inductor. Without them each of the 16 workers
# compiles a call's kernels on min(8, cores) threads and Inductor starts a pool of min(32, cores)
# compile processes per worker: up to 128 threads and 256 processes on 16 cores. Then the
# stop checklist's decoding (1B, 4K / 32K, both caches, +- dense kv head 0, beside SDPA) and the
# host time per call at 4K. About 330 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card2.txt
HF_HILBERT_COMPILE_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 TRITON_CACHE_DIR=/tmp/suite_cold2 \
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cold2 timeout 185 python -m pytest -q -m gpu -n 16 \
  -p no:benchmark -p no:cacheprovider --durations=30 tests > $OUT/gpu_suite_cold_1thread.txt 2>&1
tail -1 $OUT/gpu_suite_cold_1thread.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold_1thread.txt | head
timeout 110 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 8 s51 2>&1 \
  | grep -v -i warn | tee $OUT/interleave_1b.txt
timeout 30 python examples/benchmarks/host_overhead.py --seq 4096 2>&1 | grep -v -i warn \
  | tee $OUT/host_4k.txt
