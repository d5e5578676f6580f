#!/bin/bash
# Session 23: the README's attention and 1B tables re-measured after D64, one H200.
o=${OUT:-/tmp/out}; mkdir -p $o
export PYTHONPATH=$PWD
nvidia-smi -L | tee $o/gpu.txt
timeout 200 python examples/benchmarks/kernel_timing.py --no-check --seq 16384 65536 131072 --dense \
  --pattern longnet_lm pow2 default sliding_sparse --csv $o/attention_H200.csv 2>&1 \
  | grep -v "arn" | tee $o/attention_H200.log
L=liger; python -c "import liger_kernel" 2>/dev/null || L=chunked
echo "loss: $L" | tee $o/bench_model.log
B="python -m hf_hilbert_attn.tools.cli bench model --preset 1b --loss $L --warmup 1 --iters 2 --no-plots --no-progress"
timeout 200 $B --impls sdpa hilbert_dilated --pattern default --out-dir $o/bm_default 2>&1 | grep -v "arn" | tee -a $o/bench_model.log
timeout 150 $B --impls hilbert_dilated --pattern configs/patterns/default_kv0_dense.yaml --out-dir $o/bm_kv0 2>&1 | grep -v "arn" | tee -a $o/bench_model.log
