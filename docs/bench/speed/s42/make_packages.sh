#!/bin/bash
# The packages run_next.sh carries, under .scratch/ (git-ignored), from the repository root:
#   head  - `git archive 24dd31d hf_hilbert_attn` (the library at session 42's end)
#   pairq - head + dq_pair_tile.patch: dq launches that test the union rule pair by pair
#           through the key tables (longnet_lm's rates 6 and 12) take a 128 x 32 tile with a
#           third stage (sm_90, CPU compile: 0 / 0 spill bytes against 56 / 136)
set -e
rm -rf .scratch/head .scratch/pairq; mkdir -p .scratch/head
git archive 24dd31d hf_hilbert_attn | tar -x -C .scratch/head
cp -r .scratch/head .scratch/pairq
(cd .scratch/pairq && patch -s -p1 < ../../docs/bench/speed/s42/dq_pair_tile.patch)
echo "made .scratch/{head,pairq}"
