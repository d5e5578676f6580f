#!/bin/bash
# For the next session (about 540 s on an H100; session 51 got no machine: four starts failed and
# the device was then paused). It replaces docs/bench/speed/s50/run_next.sh: the same timings,
# the GPU suite whole and cold instead of a subset (the diff changes loops every pattern runs;
# the suite's cold time is issue 38's), the most needed first. Before the call, on the CPU
# machine:
#   git apply docs/bench/speed/s50/edge_unpipelined.diff
#   mkdir -p ab_old && git archive HEAD hf_hilbert_attn | tar -x -C ab_old \
#       && mv ab_old/hf_hilbert_attn ab_old/hf_old        # (not committed; delete after)
# Then, with the forward's and dq's masked key loops unpipelined (the diff) against the package
# before (ab_old/hf_old) in one process: forwards per pattern at 64K (outputs compared: the same
# arithmetic, another schedule), the dense forward and `default` fwd+bwd (ab_one.py), `longnet_lm`
# and `pow2` fwd+bwd at head size 64 (sm_90 screen: their launches after the first spill 32 / 64
# bytes at head size 128 before the diff and none after; `longnet_lm`'s dq with the per-pair
# union mask at 64, 80 / 220 -> 36 / 56); the GPU suite on its own cold Triton cache first; the
# 135M step at 4K beside SDPA; where the library's 512-token band forward loses 11-16 % to a
# plain kernel (band_gap.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=docs/bench/speed/s49/patterns
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
# (every compile logged per worker with the test that made it: docs/bench/speed/s43/compile_log.py)
TRITON_CACHE_DIR=/tmp/suite_cold COMPILE_LOG=/tmp/clog HF_HILBERT_TEST_TIMELINE=/tmp/clog \
  PYTHONPATH=$PWD:$PWD/docs/bench/speed/s43 timeout 185 python -m pytest -q -m gpu -n 16 \
  -p no:benchmark -p no:cacheprovider -p compile_log --durations=30 tests \
  > $OUT/gpu_suite_cold.txt 2>&1
tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
tar czf $OUT/suite_compiles.tgz -C /tmp clog
timeout 110 python docs/bench/speed/s50/ab_fwd.py --seq 65536 -n 5 --pattern default \
  sliding_sparse longnet_lm pow2 $P/band512.yaml 2>&1 | grep -v -i warn | tee $OUT/ab_fwd_64k.txt
timeout 70 python docs/bench/speed/s48/ab_one.py --seq 65536 2>&1 | grep -v -i warn | tail -3 \
  | tee $OUT/ab_one_64k.txt
timeout 60 python docs/bench/speed/s50/ab_fwd.py --seq 65536 --dim 64 --backward -n 3 --pattern \
  longnet_lm pow2 2>&1 | grep -v -i warn | tail -2 | tee $OUT/ab_fwdbwd_64k_d64.txt
timeout 80 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 6 s51 2>&1 | grep -v -i warn \
  | tee $OUT/stepinter_135m_4k.txt
timeout 60 python docs/bench/speed/s50/band_gap.py --seq 65536 2>&1 | grep -v -i warn \
  | tee $OUT/band_gap.txt
