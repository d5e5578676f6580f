#!/usr/bin/env bash
# The pending single-GPU measurements in stages that each fit one 10-minute device call.
#
#   bash examples/benchmarks/single_gpu_suite.sh OUT_DIR [STAGES]
#
# STAGES (comma list; default tests,ab):
#   tests      GPU tests (kernels vs float32 references in bf16/fp16, transformers, autocast)
#   ab         kernel variants at 64K (ab_variants.sh): the defaults, 32/8 heads D 128 and
#              32/32 heads D 64, and the forward's table launches at 64 x 64 (docs/decisions.md)
#   attn16     bench_attention.py matrix at 16K and 32K (Hkv 32,8; D 128,64; both patterns)
#   attn64     the same at 64K
#   attn128    the same at 128K
#   model      bench_model.py (1B shape) with and without --compile
#   maxlen     bench_ring.py --mode max-len on one GPU (head-chunked backward buffers)
# Everything printed goes to OUT_DIR/suite.log; CSVs and PNGs to OUT_DIR.
set -uo pipefail
OUT_DIR=${1:?output directory}
STAGES=${2:-tests,ab}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/suite.log"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; }
KT=examples/benchmarks/kernel_timing.py
BA=examples/benchmarks/bench_attention.py

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$LOG"
has tests && step python -m pytest -q -m gpu -n 8 --durations=40 tests  # per-test times: the 90 s target
if has ab; then
  # registers/spills of the binaries being timed, from the device's own Triton
  step python examples/benchmarks/kernel_resources.py --csv "$OUT_DIR/kernel_resources.csv"
  # the defaults as one call (docs/decisions.md "Union tables in the forward" timed each kernel
  # apart), and the forward's table launches at 64 x 64 instead of 64 x 32
  step bash examples/benchmarks/ab_variants.sh "$OUT_DIR/ab" 65536 'defaults@32,8,128:' \
    'fwd64@32,8,128:HF_HILBERT_FWD_BLOCKS=64,64,4,3' 'defaults64@32,32,64:'
fi
for s in 16 64 128; do
  case $s in 16) lens=16K,32K ;; 64) lens=64K ;; 128) lens=128K ;; esac
  has attn$s && step python $BA --seq-lens $lens --out-dir "$OUT_DIR" --tag "_s$s"
done
if has model; then
  step python examples/benchmarks/bench_model.py --preset 1b --out-dir "$OUT_DIR"
  step python examples/benchmarks/bench_model.py --preset 1b --compile --lengths 64k --out-dir "$OUT_DIR"
fi
has maxlen && step python examples/benchmarks/bench_ring.py --mode max-len --layouts zigzag \
    --out-dir "$OUT_DIR"
echo "=== $(date +%T) done" | tee -a "$LOG"
