#!/bin/bash
# For the next session (about 560 s on an H100; not run in session 49: its device time ran out).
# Before the call, on the CPU machine: git apply docs/bench/speed/s49/static_generate_once.diff
# Then: the GPU suite cold with the mixed layers' static-cache generate test compiling once
# (89 s of session 49's 136 s cold suite was that unit: three Inductor compiles); then where a
# short sliding band's forward loses time (issue 34): a 512-token band alone (no merge, no sink),
# with one sink key, sliding_sparse without and with its sink, per launch at 64K beside our dense
# kernel; the band on 64 x 64 / 4 warps and on 128 x 32 / 8 warps (FWD1: the launches without an
# earlier config); and band_probe.py: the band alone in plain Triton, one query head a program
# (our schedule), a key/value head's query heads packed in a program's rows, and persistent
# programs walking a flattened loop, beside our library's forward of the same band.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P=docs/bench/speed/s49/patterns
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
timeout 175 python -m pytest -q -m gpu -n 16 -p no:benchmark -p no:cacheprovider --durations=40 \
  tests > $OUT/gpu_suite_cold.txt 2>&1
tail -1 $OUT/gpu_suite_cold.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_suite_cold.txt | head
grep -E "s call .*(static|soft_capped|sliding_sinks)" $OUT/gpu_suite_cold.txt | head -4
timeout 90 python examples/benchmarks/kernel_timing.py --no-check --seq 65536 --profile --dense \
  --pattern $P/band512.yaml $P/band512_sink.yaml $P/sliding_sparse_nosink.yaml \
  sliding_sparse 2>&1 | grep -v -i warn > $OUT/bands.txt
grep -E "^(ours|÷|profile)" $OUT/bands.txt | cut -c1-220
for t in 64,64,4,3 128,32,8,3; do  # (file names with commas do not come back from the device)
HF_HILBERT_FWD1_BLOCKS=$t timeout 50 python examples/benchmarks/kernel_timing.py --no-check \
  --seq 65536 --profile --pattern $P/band512.yaml $P/band512_sink.yaml 2>&1 | grep -v -i warn \
  > $OUT/bands_fwd1_$t.txt
echo "FWD1=$t"; grep -E "^(ours|profile)" $OUT/bands_fwd1_$t.txt | cut -c1-220
done
timeout 100 python docs/bench/speed/s49/band_probe.py --seq 16384 65536 2>&1 | grep -v -i warn \
  | tee $OUT/band_probe.txt
timeout 120 python docs/bench/speed/s49/step_floor.py 1b 65536 3 2>&1 | grep -v -i warn \
  | tee $OUT/step_floor_1b.txt
