#!/bin/bash
# Prepared for the next session's first call (not run): what stalls the dk/dv kernel (D88).
# Lists the profilers on the device image; where Nsight Compute is there, profiles one launch
# of the band's dk/dv kernel and, for comparison, of its forward (the 2048-token band alone,
# docs/bench/speed/s43/patterns/band2048.yaml, Hq 32 / Hkv 8, D 128, bf16, 64K): speed of
# light, warp states (stall reasons), scheduler, occupancy and launch statistics, as text.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
for t in ncu nsys; do echo "$t: $(command -v $t || echo absent)"; done | tee $OUT/profilers.txt
command -v ncu > /dev/null || exit 0
for k in _dkdv_kernel _fwd_kernel; do
  PYTHONPATH=$PWD timeout 240 ncu --target-processes all --kernel-name regex:"$k" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --rep-ms 20 \
    --pattern docs/bench/speed/s43/patterns/band2048.yaml > $OUT/ncu_band$k.txt 2>&1
  grep -E "Stall|Issued|Throughput|Occupancy|Registers|Duration" $OUT/ncu_band$k.txt | head -40
done
