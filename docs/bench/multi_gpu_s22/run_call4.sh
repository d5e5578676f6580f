#!/bin/bash
# call 4 (nvidia-h200-x4): Ulysses head chunks 1/2(/4) beside the ring, W=4 then W=2; bf16 check
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
torchrun --nproc_per_node 4 docs/bench/multi_gpu_s22/ucmp.py 32,128 1,2 > $R/ucmp_w4.log 2>&1
echo "w4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 docs/bench/multi_gpu_s22/ucmp.py 32,128 1,2,4 > $R/ucmp_w2.log 2>&1
echo "w2 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
torchrun --nproc_per_node 4 examples/benchmarks/bench_ring.py --mode correctness --seq-len 32K --pattern default --sp-modes ulysses --layouts contiguous,zigzag --out-dir $R/corr > $R/corr4.log 2>&1
echo "corr4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
cd $OUT && tar czf r.tgz r && rm -rf r
