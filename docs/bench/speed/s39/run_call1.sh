#!/bin/bash
# Device call 1 of session 39: (1) issue 34: dk/dv programs only for the classes a group reads
# (this tree) against the previous commit (.scratch/base: `git archive a468eeb
# hf_hilbert_attn`), per config and kernel at 64K, default and sliding_sparse with and without
# their sink token; (2) the GPU kernel tests; (3) the A/B again without the profiler; (4) s38's
# last PatternCache order (8db0be3): in room / concatenated at 4K and 128K, as time allows.
# BUDGET: the seconds the call may take (default 560).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
S=docs/bench/speed/s39 B=${BUDGET:-560}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
left() { echo $(( B - $1 - $(date +%s) + t0 )); }
ab() {  # tag [--profile]
  local tag=$1 pkg=$PWD; [ ${tag:0:4} = base ] && pkg=$PWD/.scratch/base
  echo "=== $tag" | tee -a $OUT/profile_64k.txt
  PYTHONPATH=$pkg timeout 100 python examples/benchmarks/kernel_timing.py --no-check \
    --seq 65536 $2 --pattern default $S/default_nosink.yaml sliding_sparse \
    $S/sliding_sparse_nosink.yaml --csv $OUT/profile_64k_$tag.csv 2>&1 | grep -v -i warn \
    | tee -a $OUT/profile_64k.txt
  echo "profile $tag wall $(( $(date +%s) - t0 )) s"
}
ab base --profile; ab new --profile
timeout $(left 130) python -m pytest -q -m gpu -n 16 -p no:benchmark --durations=15 \
  tests/test_kernels_gpu.py tests/test_dense_heads_gpu.py tests/test_decode.py \
  > $OUT/gpu_kernel_tests.txt 2>&1; tail -1 $OUT/gpu_kernel_tests.txt
grep -E "^(FAILED|ERROR)" $OUT/gpu_kernel_tests.txt; echo "tests wall $(( $(date +%s) - t0 )) s"
[ $(left 60) -gt 0 ] && ab base2; [ $(left 30) -gt 0 ] && ab new2
[ $(left 0) -gt 60 ] && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(left 0) python \
  docs/bench/speed/s38/cache_ab2.py 4096,131072 12 2>&1 | grep -v Warn | tee $OUT/cache_ab2.txt
echo "total wall $(( $(date +%s) - t0 )) s"
