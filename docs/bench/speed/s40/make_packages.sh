#!/bin/bash
# The packages run_call1.sh compares, under .scratch/ (git-ignored; carry all five):
# run from the repository root.
set -e
for p in head:9476c59 base:a468eeb; do
  rm -rf .scratch/${p%%:*}; mkdir -p .scratch/${p%%:*}
  git archive ${p#*:} hf_hilbert_attn | tar -x -C .scratch/${p%%:*}
done
rm -rf .scratch/new .scratch/varV; cp -r .scratch/head .scratch/new
(cd .scratch/new && patch -s -p1 < ../../docs/bench/speed/s40/sink_first.patch)
cp -r .scratch/new .scratch/varV  # the sink keys one at a time (no tensor-core tile)
sed -i 's/BN=16, D=D, EDGE=True, UNION=True, UTAB=0/BN=1, D=D, EDGE=True, UNION=True, UTAB=0/' \
  .scratch/varV/hf_hilbert_attn/kernels/_fwd.py .scratch/varV/hf_hilbert_attn/kernels/_bwd.py
python - <<'PY'
import re
for f, pairs in {
    ".scratch/varV/hf_hilbert_attn/kernels/_fwd.py": [
        ("s = _logits2(_dot(q, tl.trans(k), None, F.IEEE), scales, F.SOFTCAP)[0]",
         "s = _logits2(_dot(q, tl.trans(k), None, F.IEEE) if BN > 1 else tl.sum(q.to(tl.float32) * k.to(tl.float32), 1)[:, None], scales, F.SOFTCAP)[0]"),
        ("acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], F.IEEE)",
         "acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], F.IEEE) if BN > 1 else acc * alpha[:, None] + p * v.to(tl.float32)")],
    ".scratch/varV/hf_hilbert_attn/kernels/_bwd.py": [
        ("s = _dot(q, tl.trans(k), None, F.IEEE)",
         "s = _dot(q, tl.trans(k), None, F.IEEE) if BN > 1 else tl.sum(q.to(tl.float32) * k.to(tl.float32), 1)[:, None]"),
        ("dp = _dot(do, tl.trans(v), None, F.IEEE)",
         "dp = _dot(do, tl.trans(v), None, F.IEEE) if BN > 1 else tl.sum(do.to(tl.float32) * v.to(tl.float32), 1)[:, None]"),
        ("dq = _dot(ds.to(k.dtype), k, dq, F.IEEE)",
         "dq = _dot(ds.to(k.dtype), k, dq, F.IEEE) if BN > 1 else dq + ds * k.to(tl.float32)"),
        ("dkp = _dot(tl.trans(ds.to(q.dtype)), q, None, F.IEEE)",
         "dkp = _dot(tl.trans(ds.to(q.dtype)), q, None, F.IEEE) if BN > 1 else tl.sum(ds * q.to(tl.float32), 0)[None, :]"),
        ("dvp = _dot(tl.trans(p.to(do.dtype)), do, None, F.IEEE)",
         "dvp = _dot(tl.trans(p.to(do.dtype)), do, None, F.IEEE) if BN > 1 else tl.sum(p * do.to(tl.float32), 0)[None, :]")]}.items():
    s = open(f).read()
    for a, b in pairs:
        assert s.count(a) == 1, (f, a)
        s = s.replace(a, b)
    open(f, "w").write(s)
PY
# varU (timing only, wrong where a config also allows a sink pair): new without the sink run's
# per-pair union test, to learn whether that test (a loop of scalar loads over every config) is
# the sink run's cost
rm -rf .scratch/varU; cp -r .scratch/new .scratch/varU
sed -i 's/BN=16, D=D, EDGE=True, UNION=True, UTAB=0/BN=16, D=D, EDGE=True, UNION=False, UTAB=0/' \
  .scratch/varU/hf_hilbert_attn/kernels/_fwd.py .scratch/varU/hf_hilbert_attn/kernels/_bwd.py
[ $(grep -c "UNION=False, UTAB=0" .scratch/varU/hf_hilbert_attn/kernels/_[fb]*.py | \
  awk -F: '{s+=$2} END {print s}') -ge 2 ]
echo "made .scratch/{head,base,new,varV,varU}"
