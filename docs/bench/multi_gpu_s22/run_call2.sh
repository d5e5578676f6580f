#!/bin/bash
# call 2 (nvidia-h200-x4): GPU suite; kernels A/B (HEAD vs working tree, D128 32/8);
# ulysses bf16 correctness at W=4 with the token-major exchange
export NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
PYTHONPATH=$PWD python -m pytest -q -m gpu -n 16 tests --durations=8 > $R/gpu_suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
KT="examples/benchmarks/kernel_timing.py --seq 16384 65536 --pattern default sliding_sparse --dense --no-check --rep-ms 200"
CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD python $KT --csv $R/kt_new1.csv > $R/kt_new1.log 2>&1 &
CUDA_VISIBLE_DEVICES=2 PYTHONPATH=$PWD/.scratch/base python $KT --csv $R/kt_base.csv > $R/kt_base.log 2>&1 &
wait
echo "kt1 $(( $(date +%s) - T0 ))s" >> $R/times.txt
# swap the GPUs: a card's own speed shows as a difference between runs of one code
CUDA_VISIBLE_DEVICES=2 PYTHONPATH=$PWD python $KT --csv $R/kt_new2.csv > $R/kt_new2.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD/.scratch/base python $KT --csv $R/kt_base2.csv > $R/kt_base2.log 2>&1 &
wait
echo "kt2 $(( $(date +%s) - T0 ))s" >> $R/times.txt
PYTHONPATH=$PWD torchrun --nproc_per_node 4 examples/benchmarks/bench_ring.py --mode correctness --seq-len 32K --pattern default --sp-modes ulysses --layouts contiguous,zigzag --out-dir $R/corr > $R/corr4.log 2>&1
echo "corr4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
cd $OUT && tar czf r.tgz r && rm -rf r
