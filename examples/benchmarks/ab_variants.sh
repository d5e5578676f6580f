#!/usr/bin/env bash
# A/B of kernel variants set by environment variables, side by side in one device call.
#
#   bash examples/benchmarks/ab_variants.sh OUT_DIR S 'NAME@HQ,HKV,D:VAR=V;VAR=V' ...
#
# Each variant is a name, a shape (heads, key/value heads, head size; S tokens) and its
# environment (empty: the defaults), e.g. 'old@32,8,128:HF_HILBERT_DQ_BLOCKS=128,64,8,2' or
# 'new@32,32,64:'. First every variant
# compiles at once, one process per variant and pattern at S=4096 (same specialisations, the
# Triton cache fills in parallel); then each is timed alone at S (kernel_timing.py: median
# fwd and fwd+bwd of longnet_lm and default, useful TFLOP/s, and the per-launch profile of
# longnet_lm). Logs and CSVs: OUT_DIR/ab.log, OUT_DIR/ab_NAME.csv. AB_ARGS: more arguments
# of the timed kernel_timing.py runs (e.g. AB_ARGS=--dense: the dense pattern too).
set -uo pipefail
OUT_DIR=${1:?output directory}
S=${2:?sequence length}
shift 2
KT=examples/benchmarks/kernel_timing.py
P=hf_hilbert_attn/patterns
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/ab.log"
export PYTHONUNBUFFERED=1

timing() {  # SPEC extra args: the variant's environment and shape, then kernel_timing.py
  local spec=$1 envs shape hq hkv d
  shift
  envs=${spec#*:}
  shape=${spec%%:*}
  shape=${shape#*@}
  IFS=, read -r hq hkv d <<<"$shape"
  env ${envs//;/ } python $KT --no-check --hq "$hq" --hkv "$hkv" --dim "$d" "$@"
}

for v in "$@"; do
  name=${v%%@*}
  for pat in longnet_lm default; do
    timing "$v" --seq 4096 --pattern $P/$pat.yaml >"$OUT_DIR/warm_${name}_$pat.log" 2>&1 &
  done
done
wait
echo "=== $(date +%T) compiled" | tee -a "$LOG"
for v in "$@"; do
  name=${v%%@*}
  echo "=== $(date +%T) $v (S=$S)" | tee -a "$LOG"
  timing "$v" --seq "$S" --pattern $P/longnet_lm.yaml $P/default.yaml --profile \
    --csv "$OUT_DIR/ab_$name.csv" ${AB_ARGS:-} 2>&1 | grep -v -i warn | tee -a "$LOG"
done
