#!/bin/bash
# Device call for the sink run's settled configs (sink_settle.patch; make_packages2.sh first,
# carry .scratch/head and .scratch/varP; BUDGET seconds, default 420). Per config and kernel
# at 64K (default, sliding_sparse, longnet_lm; Hq 32 / Hkv 8, D 128, bf16), head and varP in
# turn twice; between the rounds the whole GPU suite on varP from a cold Triton cache, every
# duration (its tests compare against the reference: the settled configs must not change a
# result; and it times D85's plan: PYTHONSAFEPATH=1 keeps pytest and its workers from
# importing the checkout's package before the carried one).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1
B=${BUDGET:-420}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
left() { echo $(( B - $1 - $(date +%s) + t0 )); }
prof() {  # prof TAG...: each package in turn while RESERVE seconds are left after it
  for tag in "$@"; do
    lim=$(left $RESERVE); [ $lim -gt 30 ] || break; [ $lim -gt 100 ] && lim=100
    echo "=== $tag" | tee -a $OUT/profile_64k.txt
    PYTHONPATH=$PWD/.scratch/${tag%2} timeout $lim python examples/benchmarks/kernel_timing.py \
      --no-check --seq 65536 --profile --pattern default sliding_sparse longnet_lm \
      2>&1 | grep -v -i warn | tee -a $OUT/profile_64k.txt
    echo "wall $(( $(date +%s) - t0 )) s" | tee -a $OUT/profile_64k.txt
  done
}
RESERVE=${SUITE_S:-160} prof head varP
if [ $(left 5) -gt 60 ]; then
  lim=$(left 5); [ $lim -gt 170 ] && lim=170
  PYTHONSAFEPATH=1 PYTHONPATH=$PWD/.scratch/varP TRITON_CACHE_DIR=/tmp/tc2 timeout $lim \
    python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=0 tests \
    > $OUT/gpu_suite_cold.txt 2>&1
  tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
  echo "tests wall $(( $(date +%s) - t0 )) s"
fi
RESERVE=0 prof varP2 head2
echo "total wall $(( $(date +%s) - t0 )) s"
