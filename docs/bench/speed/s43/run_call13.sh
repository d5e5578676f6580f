#!/bin/bash
# Session 43, call 13: the attention op at SmolLM2-135M's shape (Hq 9 / Hkv 3, D 64, bf16) at
# 4K / 8K / 16K, per config and kernel, beside our dense kernel and SDPA: what a 135M training
# step's attention costs on the GPU.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
PYTHONPATH=$PWD timeout 200 python examples/benchmarks/kernel_timing.py --no-check \
  --seq 4096 8192 16384 --hq 9 --hkv 3 --dim 64 --dense --profile --pattern default \
  --csv $OUT/attention_135m.csv 2>&1 | grep -v -i warn | tee $OUT/attention_135m.txt
