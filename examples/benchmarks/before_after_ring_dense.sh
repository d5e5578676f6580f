#!/usr/bin/env bash
# The ring's in-kernel merges and the dense heads' skipped sparse share (D40), before vs after,
# in one run on the GPUs of this machine:
#
#   git archive REV hf_hilbert_attn | tar -x -C OLD_DIR      # the "before" package
#   bash examples/benchmarks/before_after_ring_dense.sh OLD_DIR OUT_DIR [GPUS]
#
# Per package: dense_heads.py on one GPU (SmolLM2-135M and Llama-3.2-1B heads, key/value head 1
# dense), then bench_ring.py --mode scaling with the default pattern on GPUS ranks
# (default: every visible GPU; nothing when fewer than 2).
set -u
OLD=$(realpath "${1:?the parent directory of the before package}"); OUT=${2:?output directory}
GPUS=${3:-$(python -c "import torch; print(torch.cuda.device_count())")}
NEW=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for tag in old new; do
  [ $tag = old ] && P=$OLD || P=$NEW
  for heads in "--hq 9 --hkv 3" "--hq 32 --hkv 8"; do
    # shellcheck disable=SC2086  # the heads are two options each
    PYTHONPATH=$P python examples/benchmarks/dense_heads.py --seq 4096 16384 65536 $heads \
        --dense 1 --csv "$OUT/dense_heads_${tag}_${heads// /}.csv"
  done > "$OUT/dense_heads_$tag.txt" 2>&1
  if [ "$GPUS" -ge 2 ]; then
    PYTHONPATH=$P torchrun --standalone --nproc_per_node "$GPUS" \
        examples/benchmarks/bench_ring.py --mode scaling --tokens-per-gpu 32K,128K \
        --pattern default --out-dir "$OUT/ring_$tag" > "$OUT/ring_${GPUS}_$tag.log" 2>&1
  fi
done
