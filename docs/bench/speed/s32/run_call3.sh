#!/bin/bash
# Device call 3 of session 32: where a 135M training step's host time goes (4K, bf16), SDPA's
# steps and ours, each alone under a sampling profiler with native frames (py-spy, carried as a
# wheel in .scratch/whl), collapsed stacks gzipped for reading here; then the steps without it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .scratch/whl/*.whl
SPY=/tmp/site/bin/py-spy; ls -la $SPY
nvidia-smi --query-gpu=name --format=csv,noheader
for m in sdpa default; do
  python docs/bench/speed/s32/scripts/step_spy.py 135m 4096 3 $m 2>&1 | grep ms/step  # (compile)
  timeout 150 $SPY record -r 400 --native --threads -f raw -o /tmp/spy_$m.txt -- \
    python docs/bench/speed/s32/scripts/step_spy.py 135m 4096 40 $m 2>&1 | grep -v -i warn | tail -4
  gzip -c /tmp/spy_$m.txt > $OUT/spy_${m}_135m_4k_H200.txt.gz; ls -la $OUT
done
for m in sdpa default sdpa default; do
  python docs/bench/speed/s32/scripts/step_spy.py 135m 4096 20 $m 2>&1 | grep ms/step
done | tee $OUT/steps_135m_4k_H200.txt
