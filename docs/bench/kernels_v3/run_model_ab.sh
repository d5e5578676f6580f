#!/bin/bash
# Session 23: the 1B-shape step at 64K, the previous commit (.scratch/base) against D64, in turn.
o=${OUT:-/tmp/out}; mkdir -p $o
L=liger; python -c "import liger_kernel" 2>/dev/null || L=chunked
for r in 1 2; do for v in base new; do
  # (python -m puts the working directory first on sys.path: run from the package's parent)
  dir=$PWD; [ $v = base ] && dir=$PWD/.scratch/base
  echo "=== $v round $r" | tee -a $o/model_ab.log
  (cd $dir && PYTHONPATH=$dir python -c "import hf_hilbert_attn.kernels._calls as c; print(c.__file__, hasattr(c, '_band_edge'))" && PYTHONPATH=$dir python -m hf_hilbert_attn.tools.cli bench model --preset 1b --loss $L --warmup 1 \
    --iters 3 --no-plots --no-progress --impls hilbert_dilated --pattern default --lengths 64k \
    --out-dir $o/m_$v$r) 2>&1 | grep "hilbert_dilated:default\|_calls" | tee -a $o/model_ab.log
done; done
