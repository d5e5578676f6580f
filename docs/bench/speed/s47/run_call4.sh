#!/bin/bash
# Session 47, call 4: the Gluon dk/dv kernel on MIXED launches (per-pair union mask, 32 queries a
# step): the GPU suite cold in fresh Triton / Inductor caches with one compile thread a worker
# (HF_HILBERT_COMPILE_THREADS=1: 16 workers, at most 16 compiles at once; call 1 ran it with the
# library's default, min(8, CPUs) threads a worker), then mixed.py against the Triton kernel on
# those launches, one process. (Planned with a second cold suite at the default for an A/B on
# one machine; cut to fit the device time left.)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=docs/bench/speed/s47
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
suite() {  # $1: tag; the rest: environment
  local tag=$1; shift
  env "$@" TRITON_CACHE_DIR=/tmp/tc_$tag TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tag timeout 200 \
    python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=25 tests \
    > $OUT/gpu_suite_cold_$tag.txt 2>&1
  echo "== $tag"; tail -1 $OUT/gpu_suite_cold_$tag.txt
  grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold_$tag.txt | head -20
}
suite threads1 HF_HILBERT_COMPILE_THREADS=1
TRITON_CACHE_DIR=/tmp/tc_threads1 timeout 120 python $S/mixed.py 32/8/128:65536@longnet_lm \
  32/8/64:65536@longnet_lm 2>&1 | grep -v -i warn | tee $OUT/mixed.txt
