#!/bin/bash
# Device call 1 of session 39: (1) issue 34: dk/dv programs only for the classes a group reads
# (this tree) against the previous commit (.scratch/base: `git archive a468eeb
# hf_hilbert_attn`), per config and kernel at 64K, default and sliding_sparse with and without
# their sink token, in turn twice; (2) the GPU suite cold with every duration; (3) s38's last
# PatternCache order (8db0be3): in room / concatenated at 4K and 128K, as time allows.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
S=docs/bench/speed/s39
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
for tag in base new base2 new2; do
  pkg=$PWD; [ ${tag:0:4} = base ] && pkg=$PWD/.scratch/base
  prof="--profile"; [ ${tag: -1} = 2 ] && prof=""
  echo "=== $tag" | tee -a $OUT/profile_64k.txt
  PYTHONPATH=$pkg timeout 100 python examples/benchmarks/kernel_timing.py --no-check \
    --seq 65536 $prof --pattern default $S/default_nosink.yaml sliding_sparse \
    $S/sliding_sparse_nosink.yaml --csv $OUT/profile_64k_$tag.csv 2>&1 | grep -v -i warn \
    | tee -a $OUT/profile_64k.txt
  echo "profile $tag wall $(( $(date +%s) - t0 )) s"
done
TRITON_CACHE_DIR=/tmp/tc2 timeout $(( ${BUDGET:-560} - 40 - $(date +%s) + t0 )) python -m pytest -q -m gpu \
  -n 16 -p no:benchmark --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1; tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
echo "suite wall $(( $(date +%s) - t0 )) s"
left=$(( ${BUDGET:-560} - $(date +%s) + t0 ))
[ $left -gt 60 ] && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $left python \
  docs/bench/speed/s38/cache_ab2.py 4096,131072 12 2>&1 | grep -v Warn | tee $OUT/cache_ab2.txt
echo "total wall $(( $(date +%s) - t0 )) s"
