#!/bin/bash
# Device call 1 of session 41 (s40's, not run there, with varS; BUDGET seconds, default 560).
# Per config and kernel at 64K (default, sliding_sparse, longnet_lm; Hq 32 / Hkv 8, D 128, bf16),
# packages in turn, each carried under .scratch/ (make them with s41/make_packages.sh):
#   head  - `git archive 9476c59 hf_hilbert_attn`: D83's final form, never timed
#   new   - head + sink_first.patch: the forward's and dq's 16-key sink tile before the band's
#           loops, not after them (sm_90, D 128: no more spills; the same sums in another order)
#   varV  - new, with the sink keys taken one at a time without a tensor-core tile (float32
#           products; sm_90 spills at head sizes 64 and 256: informative only)
#   varU  - new without the sink run's per-pair union test (wrong where a config also allows a
#           sink pair: timing only, --no-check): is that test (a loop of scalar loads over the
#           configs) the sink run's cost?
#   varS  - new with the union test's loop over the configs unrolled by 4 (make_packages.sh)
#   base  - `git archive a468eeb hf_hilbert_attn`: before D83
#   tilesA / tilesB / tilesC - head with tiles screened on the CPU for sm_90 (no spills where
#           the tile now spills; kernel_resources.py, README.md)
# head, new, varU and varS first (while SUITE_S seconds, default 150, are left), then the GPU
# suite on new's package from a cold Triton cache (every duration, what it compiled), then the
# others while the budget lasts.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc1
B=${BUDGET:-560}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
t0=$(date +%s)
left() { echo $(( B - $1 - $(date +%s) + t0 )); }
A="HF_HILBERT_FWD1_BLOCKS=64,32,4,3 HF_HILBERT_DQ_BLOCKS=64,64,8,3 HF_HILBERT_DKDV_BLOCKS=16,128,8,2"
Bv="HF_HILBERT_FWD1_BLOCKS=128,32,8,3 HF_HILBERT_DQ_BLOCKS=128,32,8,3"
C="HF_HILBERT_FWD1_BLOCKS=128,64,8,3 HF_HILBERT_FWD_BLOCKS=64,32,4,3 HF_HILBERT_DQ_BLOCKS=128,32,8,3"
prof() {  # prof TAG...: each package in turn while RESERVE seconds are left after it
  for tag in "$@"; do
    lim=$(left $RESERVE); [ $lim -gt 30 ] || break; [ $lim -gt 100 ] && lim=100
    pkg=$PWD/.scratch/${tag%2}; case $tag in tiles*) pkg=$PWD/.scratch/head;; esac
    envs=""; [ $tag = tilesA ] && envs=$A; [ $tag = tilesB ] && envs=$Bv; [ $tag = tilesC ] && envs=$C
    echo "=== $tag $envs" | tee -a $OUT/profile_64k.txt
    env $envs PYTHONPATH=$pkg timeout $lim python examples/benchmarks/kernel_timing.py --no-check \
      --seq 65536 --profile --pattern default sliding_sparse longnet_lm \
      --csv $OUT/profile_64k_$tag.csv 2>&1 | grep -v -i warn | tee -a $OUT/profile_64k.txt
    echo "wall $(( $(date +%s) - t0 )) s" | tee -a $OUT/profile_64k.txt
  done
}
RESERVE=${SUITE_S:-150} prof head new varU varS
if [ $(left 5) -gt 60 ]; then  # (timeout 0 would mean none)
  PYTHONPATH=$PWD/.scratch/new TRITON_CACHE_DIR=/tmp/tc2 timeout $(left 5) python -m pytest -q \
    -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=0 tests > $OUT/gpu_suite_cold.txt 2>&1
  tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt
  find /tmp/tc2 -name "*.cubin" | sed 's#.*/##' | sort | uniq -c | sort -rn > $OUT/gpu_suite_compiled.txt
  find /tmp/tc2 -name "*.cubin" | wc -l | tee -a $OUT/gpu_suite_compiled.txt
  echo "suite wall $(( $(date +%s) - t0 )) s"
fi
RESERVE=0 prof base tilesA tilesB tilesC varV head2 new2
echo "total wall $(( $(date +%s) - t0 )) s"
