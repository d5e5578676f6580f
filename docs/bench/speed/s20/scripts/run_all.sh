# Before / after on one GPU machine: the commit before this session's host changes unpacked in .scratch/old (git archive), this tree in .; writes under $OUT.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/card.txt
(time python -m pytest -q -m gpu -n 8 tests -p no:cacheprovider --durations=8) > $OUT/gpu_suite.txt 2>&1; tail -12 $OUT/gpu_suite.txt
python docs/bench/speed/s20/scripts/ptrmicro.py 2>&1 | tail -3 | tee $OUT/ptrmicro.txt
for r in 1 2; do
  for t in old new; do
    if [ $t = old ]; then d=.scratch/old; else d=.; fi
    (cd $d && PYTHONPATH=$PWD python examples/benchmarks/host_overhead.py --seq 4096 2>&1 | tail -2 | sed "s/^/$t r$r 4K /")
    (cd $d && PYTHONPATH=$PWD python examples/benchmarks/host_overhead.py --seq 16384 2>&1 | tail -2 | sed "s/^/$t r$r 16K /")
  done
done 2>&1 | tee $OUT/host_old_new.txt
for t in old new; do
  if [ $t = old ]; then d=.scratch/old; else d=.; fi
  (cd $d && PYTHONPATH=$PWD python $OLDPWD/docs/bench/speed/s20/scripts/stepinter.py 135m 4096,16384 16 $t 2>&1 | grep -v Warn | tail -3)
done 2>&1 | tee $OUT/step_old_new.txt
