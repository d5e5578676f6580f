#!/bin/bash
# Session 23 (issue 34): the sliding band edge (D64) against the previous commit, one GPU.
# .scratch/base holds the previous commit's package (git archive HEAD~ hf_hilbert_attn), carried
# to the device; the same benchmark script runs both (PYTHONPATH picks the package).
export NCCL_NVLS_ENABLE=0
o=${OUT:-/tmp/out}; mkdir -p $o
nvidia-smi -L | tee $o/gpu.txt
T="python examples/benchmarks/kernel_timing.py --no-check --pattern default sliding_sparse longnet_lm"
run() {  # tag, package dir, args...
  local tag=$1 pkg=$2; shift 2
  echo "=== $tag $(date +%T) $*" | tee -a $o/ab.log
  PYTHONPATH=$pkg $T "$@" 2>&1 | grep -v Warning | tee -a $o/ab.log
}
if [ "${1:-all}" != timing ]; then
  PYTHONPATH=$PWD timeout 240 python -m pytest -q -m gpu -n 8 tests/test_kernels_gpu.py \
    tests/test_decode.py 2>&1 | tail -5 | tee $o/gpu_kernel_tests.log
fi
run base .scratch/base --seq 65536 131072 --dense --csv $o/base_d128.csv
run new $PWD --seq 65536 131072 --dense --profile --csv $o/new_d128.csv
run base2 .scratch/base --seq 65536 --profile
run new2 $PWD --seq 65536
run base_d64 .scratch/base --seq 65536 --dim 64
run new_d64 $PWD --seq 65536 --dim 64 --csv $o/new_d64.csv
