"""One process, two packages (as ``s48/ab_one.py``: the previous commit's copy renamed ``hf_old``
in ``ab_old/``, not committed, against this tree's): the forward of each ``--pattern`` at
``--seq`` (32 / 8 heads, head size ``--dim``, default 128, bf16, no gradient; ``--backward``:
forward + backward), ms per call from CUDA events, rounds interleaved, the best printed; outputs
(and with ``--backward`` dq, dk, dv) compared (identical expected where the change keeps the
arithmetic).

    mkdir -p ab_old && git archive HEAD hf_hilbert_attn | tar -x -C ab_old \
        && mv ab_old/hf_hilbert_attn ab_old/hf_old
    python docs/bench/speed/s50/ab_fwd.py --seq 65536 --pattern dense default sliding_sparse
"""
import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.getcwd(), "ab_old"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s48")]
import hf_old  # noqa: E402
import hf_old.patterns  # noqa: E402
from ab_one import timed  # noqa: E402

import hf_hilbert_attn as hf_new  # noqa: E402
import hf_hilbert_attn.patterns  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--pattern", nargs="+", default=["dense", "default", "sliding_sparse"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backward", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, a.seq, a.dim, device="cuda", dtype=torch.bfloat16, generator=g,
                           requires_grad=a.backward) for h in (32, 8, 8))
    do = torch.randn_like(q)
    pkgs = {"old": hf_old, "new": hf_new}

    def case(m, name):
        pat = m.DilatedPattern.dense(a.seq) if name == "dense" else m.patterns.as_pattern(name)

        def fwd():
            if a.backward:  # (the output, then the gradients)
                out = m.dilated_attention(q, k, v, pat, backend="triton")
                return (out, *torch.autograd.grad(out, (q, k, v), do))
            with torch.no_grad():
                return (m.dilated_attention(q, k, v, pat, backend="triton"),)
        return fwd

    cases = {(p, n): case(m, n) for n in a.pattern for p, m in pkgs.items()}
    res = {key: [] for key in cases}
    for r in range(a.rounds):
        for key, fn in cases.items():
            res[key].append(timed(fn, a.n))
        print(f"round {r}: " + ", ".join(f"{p} {n} {res[p, n][-1]:.3f}" for p, n in res),
              flush=True)
    for n in a.pattern:
        same = all(map(torch.equal, cases["old", n](), cases["new", n]()))
        o, w = min(res["old", n]), min(res["new", n])
        what = "fwd+bwd" if a.backward else "forward"
        compared = "outputs and gradients" if a.backward else "outputs"
        print(f"{n} S={a.seq} D={a.dim} {what}: old {o:.3f} ms, new {w:.3f} ms (best of "
              f"{a.rounds}), new/old {w / o:.3f}, {compared} identical: {same}", flush=True)


if __name__ == "__main__":
    main()
