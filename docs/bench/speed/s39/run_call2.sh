#!/bin/bash
# Device call 2 of session 39 (not run: no device time left; the next session's first call):
# the final form of D83 (the sink keys' dk/dv sums in the first launch where it has a program
# for every key) against the previous commit (.scratch/base: `git archive a468eeb
# hf_hilbert_attn`, carried): per config and kernel at 64K, in turn twice; the GPU suite cold
# with every duration; the hot path beside SDPA (1B decoding 4K / 32K, the 135M step at 4K), as
# the call's time allows (BUDGET seconds, default 580).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1 PYTHONPATH=$PWD
B=${BUDGET:-580}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
left() { echo $(( B - $1 - $(date +%s) + t0 )); }
for tag in base new base2 new2; do
  pkg=$PWD; [ ${tag:0:4} = base ] && pkg=$PWD/.scratch/base
  prof="--profile"; [ ${tag: -1} = 2 ] && prof=""
  echo "=== $tag" | tee -a $OUT/profile_64k.txt
  PYTHONPATH=$pkg timeout 90 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 \
    $prof --pattern default sliding_sparse longnet_lm --csv $OUT/profile_64k_$tag.csv 2>&1 \
    | grep -v -i warn | tee -a $OUT/profile_64k.txt
done
echo "profiles wall $(( $(date +%s) - t0 )) s"
TRITON_CACHE_DIR=/tmp/tc2 timeout $(left 200) python -m pytest -q -m gpu -n 16 -p no:benchmark \
  --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1
tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
echo "suite wall $(( $(date +%s) - t0 )) s"
[ $(left 100) -gt 0 ] && timeout $(left 100) python docs/bench/speed/s19/scripts/interleave.py 1b \
  4096,32768 10 s39 2>&1 | grep -v Warn | tee $OUT/decode_1b.txt
[ $(left 0) -gt 60 ] && timeout $(left 0) python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 5 \
  s39 2>&1 | grep -v Warn | tee $OUT/step_135m.txt
echo "total wall $(( $(date +%s) - t0 )) s"
