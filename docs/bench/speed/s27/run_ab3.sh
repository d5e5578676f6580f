#!/bin/bash
# Device call 5: decoding (1B, 4K / 32K; DynamicCache, + dense kv head 0, PatternCache, both) and
# the 135M training step at 4K, this tree beside the previous commit (.scratch/base), in turn.
export NCCL_NVLS_ENABLE=0
for v in new base; do
  if [ $v = base ]; then P=$PWD/.scratch/base; else P=$PWD; fi
  PYTHONPATH=$P python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 "$v" 2>&1 | grep ctx=
done
bash docs/bench/speed/s27/step_ab.sh
