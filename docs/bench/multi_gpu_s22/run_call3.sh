#!/bin/bash
# call 3 (nvidia-h200-x4): W=2 scaling (default, default+kv0; ring vs ulysses) on GPUs 0,1 while
# GPU 2 / 3 run the decode / step hot path beside SDPA; then W=4 ulysses with the token-major exchange
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
R=$OUT/r; mkdir -p $R
T0=$(date +%s)
python - <<'P'
import yaml
d = yaml.safe_load(open("hf_hilbert_attn/patterns/default.yaml"))
d["dense_kv_heads"] = [0]
yaml.safe_dump(d, open("/tmp/default_kv0.yaml", "w"))
P
BR=examples/benchmarks/bench_ring.py
(CUDA_VISIBLE_DEVICES=2 timeout 280 python docs/bench/speed/s19/scripts/interleave.py 1b 4096,32768 20 s22 > $R/decode_1b.log 2>&1) &
(CUDA_VISIBLE_DEVICES=3 timeout 280 python docs/bench/speed/s20/scripts/stepinter.py 135m 4096 16 s22 > $R/step_135m.log 2>&1) &
for P in default /tmp/default_kv0.yaml; do
  tag=$(basename $P .yaml)
  CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 $BR --mode scaling --pattern $P --tokens-per-gpu 32K,128K --sp-modes ring,ulysses --layouts contiguous,zigzag --reps 5 --warmup 2 --out-dir $R/scal_$tag > $R/scal2_$tag.log 2>&1
  echo "scal2 $tag rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
done
wait
echo "hot $(( $(date +%s) - T0 ))s" >> $R/times.txt
torchrun --nproc_per_node 4 $BR --mode scaling --pattern default --tokens-per-gpu 32K,128K --sp-modes ulysses --layouts contiguous --reps 5 --warmup 2 --out-dir $R/scal4 > $R/scal4_default.log 2>&1
echo "scal4 rc=$? $(( $(date +%s) - T0 ))s" >> $R/times.txt
cd $OUT && tar czf r.tgz r && rm -rf r
