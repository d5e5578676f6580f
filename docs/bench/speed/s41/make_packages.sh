#!/bin/bash
# The packages s41's run_call1.sh carries, under .scratch/ (git-ignored), from the repository
# root: s40's five (head, base, new, varV, varU), and varS: new with the union test's runtime
# loop over the configs unrolled by 4 (tl.range's loop_unroll_factor), so that the scalar loads
# of four configs' windows and rates issue together rather than one dependent round trip each.
set -e
bash docs/bench/speed/s40/make_packages.sh
rm -rf .scratch/varS; cp -r .scratch/new .scratch/varS
python - <<'PY'
f = ".scratch/varS/hf_hilbert_attn/kernels/_common.py"
s = open(f).read()
a = "    covered = (pq < 0) | (pk < 0)  # all False, broadcast shape\n    for j in range(NPRI):"
assert s.count(a) == 1
open(f, "w").write(s.replace(a, a.replace("range(NPRI)", "tl.range(0, NPRI, loop_unroll_factor=4)")))
PY
echo "made .scratch/varS"
