#!/bin/bash
# The packages run_call2.sh carries, under .scratch/ (git-ignored), from the repository root:
#   head - `git archive 9476c59 hf_hilbert_attn` (the library as of session 41's start)
#   varP - head + sink_settle.patch: the sink run's union test settles, per program, the
#          configs that reach none of its sink pairs
set -e
rm -rf .scratch/head .scratch/varP; mkdir -p .scratch/head
git archive 9476c59 hf_hilbert_attn | tar -x -C .scratch/head
cp -r .scratch/head .scratch/varP
(cd .scratch/varP && patch -s -p1 < ../../docs/bench/speed/s41/sink_settle.patch)
echo "made .scratch/{head,varP}"
