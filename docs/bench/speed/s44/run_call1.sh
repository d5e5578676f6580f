#!/bin/bash
# Session 44, device call 1: backward tiles screened with Triton 3.6 (the device's; its sm_90
# code spills 452 bytes in the band's dk/dv tile where Triton 3.9 spilled 148), timed at head
# sizes 128 and 64; then, time left, Nsight Compute on the band's dk/dv kernel (run_next.sh of s43).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T=docs/bench/speed/s44/tiles.py
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 250 python $T 32/8/128:16384,65536 32/8/128:65536@docs/bench/speed/s43/patterns/band2048.yaml \
  32/8/128:16384@dense --tile "dkdv 32x128 w8 s1=dkdv:32,128,8,1" \
  --tile "dkdv 16x128 w8 s2=dkdv:16,128,8,2" --tile "dkdv 16x128 w8 s3=dkdv:16,128,8,3" \
  2>&1 | grep -v -i warn | tee $OUT/tiles_d128.txt
timeout 200 python $T 9/3/64:4096,16384 32/8/64:16384,65536 \
  --tile "dkdv 16x64 w4 s2=dkdv:16,64,4,2" --tile "dkdv 16x128 w8 s2=dkdv:16,128,8,2" \
  --tile "dkdv 32x128 w8 s1=dkdv:32,128,8,1" --tile "dkdv 16x64 w4 s1=dkdv:16,64,4,1" \
  2>&1 | grep -v -i warn | tee $OUT/tiles_d64.txt
for t in ncu nsys; do echo "$t: $(command -v $t || echo absent)"; done | tee $OUT/profilers.txt
command -v ncu > /dev/null || exit 0
timeout 100 ncu --target-processes all --kernel-name regex:_dkdv_kernel --launch-skip 2 \
  --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
  python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --rep-ms 20 \
  --pattern docs/bench/speed/s43/patterns/band2048.yaml > $OUT/ncu_band_dkdv.txt 2>&1
grep -E "Stall|Issued|Throughput|Occupancy|Registers|Duration|Local" $OUT/ncu_band_dkdv.txt | head -50
