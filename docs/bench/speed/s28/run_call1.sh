#!/bin/bash
# Device call 1 of session 28: where a 4K training step's time goes (GPU busy against wall,
# host profile), then the README's test command over every test with each failure's reason.
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python docs/bench/speed/s28/scripts/step_profile.py 135m 4096 6 > $OUT/step_profile_4k.txt 2>&1
grep -v Warn $OUT/step_profile_4k.txt | head -40
echo "profile wall $(( $(date +%s) - t0 )) s"
timeout 400 python -m pytest -q -n 16 -p no:benchmark -rfE --tb=line --durations=15 tests \
  > $OUT/full_suite_gpu.log 2>&1
grep -E "^(FAILED|ERROR)|^/.*(Error|error)|passed|failed" $OUT/full_suite_gpu.log | cut -c1-250 | tail -60
echo "total wall $(( $(date +%s) - t0 )) s"
