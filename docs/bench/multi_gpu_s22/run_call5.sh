#!/bin/bash
# call 5 (nvidia-h200-x4): the final Ulysses code (no head chunks; shards sorted) beside the ring, W=4; bf16 check
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
torchrun --nproc_per_node 4 docs/bench/multi_gpu_s22/ucmp.py 32,128 1 > $R/ucmp_w4_final.log 2>&1
echo "w4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
torchrun --nproc_per_node 4 examples/benchmarks/bench_ring.py --mode correctness --seq-len 32K --pattern default --sp-modes ulysses --layouts contiguous,zigzag --out-dir $R/corr > $R/corr4_final.log 2>&1
echo "corr4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
cd $OUT && tar czf r.tgz r && rm -rf r
