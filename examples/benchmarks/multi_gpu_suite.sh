#!/usr/bin/env bash
# The multi-GPU measurements of docs/multi_gpu.md in one go, for the GPUs of one host.
#
#   bash examples/benchmarks/multi_gpu_suite.sh NGPUS OUT_DIR [STAGES]
#
# STAGES: comma list of correctness,scaling,maxlen,finetune (default: all). Each stage runs the
# single-GPU baseline (world size 1) where it has one, then world size NGPUS; the CSVs of
# bench_ring.py accumulate in OUT_DIR, finetune logs go to OUT_DIR/finetune_sp*.jsonl and
# everything printed to OUT_DIR/suite.log.
set -uo pipefail
N=${1:?number of GPUs}
OUT_DIR=${2:?output directory}
STAGES=${3:-correctness,scaling,maxlen,finetune}
FT_SEQ=${FT_SEQ:-65536}        # finetune total tokens per sequence (split over the N GPUs)
FT_STEPS=${FT_STEPS:-5}
# FT_WORLDS: process counts of the finetune runs (default "1 NGPUS")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/suite.log"
RUN="torchrun --standalone --nproc_per_node $N"
B=examples/benchmarks/bench_ring.py
has() { [[ ",$STAGES," == *",$1,"* ]]; }
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; }

has correctness && step $RUN $B --mode correctness --seq-len 32K --out-dir "$OUT_DIR"
if has scaling; then
  step python $B --mode scaling --tokens-per-gpu 32K,128K --out-dir "$OUT_DIR"
  step $RUN $B --mode scaling --tokens-per-gpu 32K,128K --out-dir "$OUT_DIR"
fi
if has maxlen; then
  step python $B --mode max-len --layouts zigzag --out-dir "$OUT_DIR"
  step $RUN $B --mode max-len --layouts zigzag --out-dir "$OUT_DIR"
fi
if has finetune; then
  for n in ${FT_WORLDS:-1 $N}; do
    rm -rf "/tmp/ft_sp$n"
    step accelerate launch --num_processes "$n" --mixed_precision bf16 --dynamo_backend no \
        $( [ "$n" -gt 1 ] && echo --multi_gpu ) examples/finetune.py --model-preset 1b \
        --pattern hf_hilbert_attn/patterns/longnet_lm.yaml --seq-len "$FT_SEQ" --sp-size "$n" --loss-chunk 4096 \
        --gradient-checkpointing \
        --max-steps "$FT_STEPS" --save-every 0 --lr 1e-5 --output-dir "/tmp/ft_sp$n"
    # the model is not copied back: only the log
    cp "/tmp/ft_sp$n/train_log.jsonl" "$OUT_DIR/finetune_sp${n}_$FT_SEQ.jsonl" 2>/dev/null
  done
fi
