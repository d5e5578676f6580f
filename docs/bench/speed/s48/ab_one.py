"""One process, two packages: the previous commit's (a copy renamed ``hf_old`` in ``ab_old/``,
not committed) against this tree's, in turn, on one GPU: the dense pattern's forward and the
default pattern's forward + backward at ``--seq`` (32 / 8 heads, head size 128, bf16), ms per
call from CUDA events, three rounds; outputs and gradients compared (identical expected).

    mkdir -p ab_old && git archive HEAD hf_hilbert_attn | tar -x -C ab_old \
        && mv ab_old/hf_hilbert_attn ab_old/hf_old
    python docs/bench/speed/s48/ab_one.py --seq 65536
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.getcwd(), "ab_old"))
import hf_old  # noqa: E402
import hf_old.patterns  # noqa: E402
import hf_hilbert_attn as hf_new  # noqa: E402
import hf_hilbert_attn.patterns  # noqa: E402


def timed(fn, n):
    dev = torch.device("cuda") if torch.cuda.is_available() else None
    if dev is None:
        fn()
        return float("nan")
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=5)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    print(torch.cuda.get_device_name() if dev == "cuda" else "cpu", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, a.seq, a.dim, device=dev, dtype=dt, generator=g)
               for h in (a.hq, a.hkv, a.hkv))
    do = torch.randn_like(q)
    pkgs = {"old": hf_old, "new": hf_new}
    cases = {}
    for name, m in pkgs.items():
        dense, default = m.DilatedPattern.dense(a.seq), m.patterns.as_pattern("default")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd(m=m, dense=dense):
            with torch.no_grad():
                return m.dilated_attention(q, k, v, dense, backend="triton")

        def fb(m=m, qg=qg, kg=kg, vg=vg, default=default):
            for t in (qg, kg, vg):
                t.grad = None
            o = m.dilated_attention(qg, kg, vg, default)
            o.backward(do)
            return o, qg.grad, kg.grad, vg.grad

        cases[name] = (fwd, fb)
    res = {(name, what): [] for name in pkgs for what in ("fwd", "fb")}
    outs = {}
    for r in range(a.rounds):
        for name, (fwd, fb) in cases.items():
            res[name, "fwd"].append(timed(fwd, a.n))
            res[name, "fb"].append(timed(fb, a.n))
            if r == 0:
                outs[name] = (fwd(), *fb())
        print(f"round {r}: " + ", ".join(f"{n} {w} {res[n, w][-1]:.2f} ms" for n, w in res),
              flush=True)
    same = [torch.equal(x, y) for x, y in zip(outs["old"], outs["new"])]
    print(f"identical (dense out, default out, dq, dk, dv): {same}")
    for w, label in (("fwd", "dense forward"), ("fb", "default fwd+bwd")):
        o, n = min(res["old", w]), min(res["new", w])
        print(f"{label} S={a.seq}: old {o:.2f} ms, new {n:.2f} ms (best of {a.rounds}), "
              f"new/old {n / o:.3f}")


if __name__ == "__main__":
    main()
