#!/bin/bash
# Device call 1 of session 27: where a training call's host time goes (host_parts.py), and the
# decode row never measured (PatternCache with a dense kv head, s19 interleave.py).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python docs/bench/speed/s27/scripts/host_parts.py 4096 100 2>&1 | tee $OUT/host_parts_4k.txt | grep -v Warn
python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 s27 2>&1 | grep ctx= | tee $OUT/decode_1b.txt
