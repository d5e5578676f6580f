#!/bin/bash
# Device call 4 of session 31 (right after call 3): host µs per attention call in a loop
# (135M heads, 4K; new / base twice in turn), then training steps as Trainer(bf16=True) runs
# them (float32 weights under bf16 autocast) beside SDPA, with the attention calls' host time
# inside the steps; new, then base.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
t0=$(date +%s)
for r in 1 2; do for v in new base; do
  P=$PWD; [ $v = base ] && P=$PWD/.scratch/base
  echo "== $v run $r"; PYTHONPATH=$P:$PWD timeout 60 python examples/benchmarks/host_overhead.py --seq 4096 2>&1 | grep "^| [fb]"
done; done | tee $OUT/host_4k.txt
echo "host $(( $(date +%s) - t0 )) s"
for v in new base; do
  P=$PWD; [ $v = base ] && P=$PWD/.scratch/base
  PYTHONPATH=$P timeout 100 python docs/bench/speed/s31/scripts/step_autocast.py 135m 4096,8192 5 $v 2>&1 | grep -v -i warn
done | tee $OUT/step_autocast.txt
echo "total $(( $(date +%s) - t0 )) s"
