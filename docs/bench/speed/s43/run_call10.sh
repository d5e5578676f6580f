#!/bin/bash
# Session 43, call 10: the attention op side by side at 16K / 64K / 128K on one H100 (Hq 32 /
# Hkv 8, D 128, bf16): every shipped sparse pattern, our dense kernel, SDPA; per config and
# kernel at each length (--profile).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
PYTHONPATH=$PWD timeout 480 python examples/benchmarks/kernel_timing.py --no-check --seq 16384 65536 131072 \
  --dense --profile --pattern longnet_lm pow2 default sliding_sparse --csv $OUT/attention.csv \
  2>&1 | grep -v -i warn | tee $OUT/attention.txt
