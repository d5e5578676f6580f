#!/usr/bin/env bash
# Short-sequence speed, before vs after, on one GPU in one run (docs/bench/speed/):
#
#   git archive REV hf_hilbert_attn | tar -x -C OLD_DIR      # the "before" package
#   bash examples/benchmarks/before_after_short.sh OLD_DIR OUT_DIR
#
# Kernel times (Llama-3.2-1B heads), host time per call (SmolLM2-135M and 1B heads) and
# training steps (bench model 135m and 1b) at 4K-16K, first with OLD_DIR's package, then with
# this checkout's.
set -u
OLD=$(realpath "${1:?the parent directory of the before package}"); OUT=${2:?output directory}
NEW=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for tag in old new; do
  [ $tag = old ] && P=$OLD || P=$NEW
  CLI=hf_hilbert_attn.cli; [ -e "$P/hf_hilbert_attn/tools/cli.py" ] && CLI=hf_hilbert_attn.tools.cli
  for s in 4096 8192 16384; do
    PYTHONPATH=$P python examples/benchmarks/host_overhead.py --seq $s --repeats 10 2>&1 | grep "^|\|host overhead"
    PYTHONPATH=$P python examples/benchmarks/host_overhead.py --seq $s --hq 32 --hkv 8 --dim 64 --repeats 10 2>&1 | grep "^| [fb]"
  done > "$OUT/host_$tag.txt"
  PYTHONPATH=$P python examples/benchmarks/kernel_timing.py --seq 4096 8192 16384 --hq 32 --hkv 8 --dim 64 \
      --pattern default --no-check > "$OUT/kernel_timing_$tag.txt" 2>&1
  PYTHONPATH=$P python -m $CLI bench model --preset 135m --pattern default \
      --lengths 1k 2k 4k 8k 16k --impls sdpa hilbert_dilated --warmup 3 --iters 15 --no-plots --no-progress \
      --out-dir "/tmp/bench_model_135m_$tag" > "$OUT/bench_model_$tag.log" 2>&1
  PYTHONPATH=$P python -m $CLI bench model --preset 1b --pattern default \
      --lengths 4k 8k 16k --impls sdpa hilbert_dilated --warmup 2 --iters 6 --no-plots --no-progress \
      --out-dir "/tmp/bench_model_1b_$tag" >> "$OUT/bench_model_$tag.log" 2>&1
done
