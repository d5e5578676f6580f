#!/bin/bash
# call 1 (nvidia-h200-x4): ulysses bf16 correctness at W=4, scaling at W=4 (default, default+kv0)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
nvidia-smi -L > $R/gpus.txt
python - <<'P'
import yaml
d = yaml.safe_load(open("hf_hilbert_attn/patterns/default.yaml"))
d["dense_kv_heads"] = [0]
yaml.safe_dump(d, open("/tmp/default_kv0.yaml", "w"))
P
BR=examples/benchmarks/bench_ring.py
T0=$(date +%s)
torchrun --nproc_per_node 4 $BR --mode correctness --seq-len 32K --pattern default --sp-modes ulysses,ring --layouts contiguous --out-dir $R/corr > $R/corr4.log 2>&1
echo "corr4 $(( $(date +%s) - T0 ))s rc=$?" >> $R/times.txt
for P in default /tmp/default_kv0.yaml; do
  tag=$(basename $P .yaml)
  torchrun --nproc_per_node 4 $BR --mode scaling --pattern $P --tokens-per-gpu 32K,128K --sp-modes ring,ulysses --layouts contiguous,zigzag --reps 5 --warmup 2 --out-dir $R/scal_$tag > $R/scal4_$tag.log 2>&1
  echo "scal4 $tag $(( $(date +%s) - T0 ))s rc=$?" >> $R/times.txt
done
cd $OUT && tar czf r.tgz r && rm -rf r
