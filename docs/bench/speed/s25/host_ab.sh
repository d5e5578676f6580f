#!/bin/bash
# Host µs per attention call (135M heads, 4K), this commit ("new") and the previous one ("base":
# .scratch/base, `git archive HEAD~ hf_hilbert_attn`, carried) in turn, ROUNDS times, appended
# to LOG.  bash host_ab.sh LOG ROUNDS
for r in $(seq "$2"); do
  for tag in new base; do
    pkg=$PWD; [ $tag = base ] && pkg=$PWD/.scratch/base
    echo "=== $tag run $r" | tee -a "$1"
    PYTHONPATH=$pkg:$PWD timeout 120 python examples/benchmarks/host_overhead.py --seq 4096 2>&1 \
      | grep "^| [fb]" | tee -a "$1"
  done
done
