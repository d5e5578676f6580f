#!/bin/bash
# call 6 (nvidia-h200-x4 as 2 "nodes" of 2 GPUs: two torchruns, LOCAL_WORLD_SIZE=2): hybrid bf16 check and timing
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
BR=examples/benchmarks/bench_ring.py
run2x2() {
  local tag=$1; shift
  CUDA_VISIBLE_DEVICES=2,3 torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 $BR "$@" > $R/${tag}_node1.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0,1 torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 $BR "$@" > $R/${tag}.log 2>&1
  wait
}
T0=$(date +%s)
run2x2 corr --mode correctness --seq-len 32K --pattern default --sp-modes hybrid --layouts contiguous,zigzag --out-dir $R/corr
echo "corr $(( $(date +%s) - T0 ))s" >> $R/times.txt
run2x2 scal --mode scaling --pattern default --tokens-per-gpu 32K,128K --sp-modes ring,ulysses,hybrid --layouts contiguous --reps 5 --warmup 2 --out-dir $R/scal
echo "scal $(( $(date +%s) - T0 ))s" >> $R/times.txt
cd $OUT && tar czf r.tgz r && rm -rf r
