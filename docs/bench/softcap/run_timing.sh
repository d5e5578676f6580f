#!/bin/bash
# Session 24 (D66), one GPU: the kernels without a cap against the previous commit
# (.scratch/base: git archive HEAD~ hf_hilbert_attn, carried), then what a cap costs at Gemma 2's
# head size; the hot path beside SDPA (135M step at 4K; 1B decoding at 4K / 32K).
o=${OUT:-/tmp/out}; mkdir -p $o
export NCCL_NVLS_ENABLE=0
nvidia-smi -L | tee $o/gpu.txt
T="python examples/benchmarks/kernel_timing.py --no-check"
run() {  # tag, package dir, args...
  local tag=$1 pkg=$2; shift 2
  echo "=== $tag $(date +%T) $*" | tee -a $o/timing.log
  PYTHONPATH=$pkg $T "$@" 2>&1 | grep -v Warning | tee -a $o/timing.log
}
run base .scratch/base --pattern default sliding_sparse --seq 65536
run new $PWD --pattern default sliding_sparse --seq 65536
run base2 .scratch/base --pattern default sliding_sparse --seq 65536
run new2 $PWD --pattern default sliding_sparse --seq 65536
run softcap $PWD --pattern default --seq 32768 --hq 16 --hkv 8 --dim 256 --softcap 50 --dense \
  --csv $o/softcap_d256.csv
export PYTHONPATH=$PWD
timeout 150 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 s24 2>&1 \
  | grep -v arn | tail -5 | tee $o/step_interleaved_135m.log
timeout 170 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 s24 2>&1 \
  | grep -v arn | tail -25 | tee $o/decode_interleaved_1b.log
