"""What dense key/value heads cost, side by side in one run (GPU).

    python examples/benchmarks/dense_heads.py --seq 4096 16384 65536 --csv dense_heads.csv

For each length, forward+backward (bf16, causal, B = 1) of:

* ``sparse``  the pattern alone, every head;
* ``hybrid``  the pattern with ``--dense`` of its key/value heads dense (the op runs the sparse
  pattern over the other heads and plain attention over the dense heads' slice: dense_heads.py);
* ``sdpa_slice``  SDPA (FlashAttention) causal on the dense heads' slice alone — the fastest
  dense path for the same heads;
* ``sdpa``  SDPA on every head (dense attention, the baseline a user compares with).

``dense efficiency`` = ``sdpa_slice / (hybrid - (1 - f) sparse)``, ``f`` the dense share of the
heads: how fast the dense heads run inside the op (what ``hybrid`` costs beyond the sparse heads'
share of ``sparse``) compared with the fastest dense path for those heads (1.0 = as fast). Logs
from before D40, when the sparse pattern also ran over the dense heads, used ``hybrid - sparse``.

``--graphs`` times each forward+backward replayed from a CUDA graph (what
``torch.compile(mode="reduce-overhead")`` runs): GPU time alone, without the host's launches,
which bound short calls.

``--pattern`` may carry dense heads of its own (e.g. ``configs/patterns/default_kv0_dense.yaml``):
``sparse`` is then its sparse part, and ``--dense`` defaults to its dense heads. ``--device cpu``
runs the same rows on the PyTorch path (wall clock): a smoke run, its timings mean nothing.
"""

import argparse
import csv

import torch
import torch.nn.functional as F
import triton

from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.tools.benchmarks import common as C


def _fwd_bwd(fn, q, k, v, graphs=False, rep=200.0):
    def run():
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    if not q.is_cuda:  # CPU smoke run: the wall clock
        return C.bench_ms(run, q.device, rep_ms=rep, grad_to_none=[q, k, v], min_reps=1)
    if graphs:  # warm up on a side stream (plans, compiles), then capture forward + backward
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(side)
        q.grad = k.grad = v.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return triton.testing.do_bench(graph.replay, warmup=20, rep=rep, return_mode="median")
    return triton.testing.do_bench(run, warmup=20, rep=rep, return_mode="median",
                                   grad_to_none=[q, k, v])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--pattern", default="default")
    ap.add_argument("--dense", type=int, nargs="+", default=None,
                    help="dense kv heads (default: the pattern's own, else 0 5)")
    ap.add_argument("--graphs", action="store_true", help="replay from CUDA graphs (GPU time)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--device", default="cuda",
                    help="cuda (default) or cpu: the PyTorch path, a smoke run")
    ap.add_argument("--rep-ms", type=float, default=200.0,
                    help="timing budget per measurement in ms (do_bench's rep; default 200)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu runs the PyTorch path (a smoke run)")
    if args.graphs and dev.type != "cuda":
        ap.error("--graphs replays CUDA graphs: it needs --device cuda")
    if args.hkv < 1 or args.hq % args.hkv:
        ap.error(f"--hq ({args.hq}) must be a multiple of --hkv ({args.hkv})")
    given = as_pattern(args.pattern)
    if args.dense is None:
        args.dense = list(given.dense_kv_heads) or [0, 5]
    sparse = given.sparse_part  # the pattern alone: no dense heads, its own or --dense
    hybrid = sparse.replace(dense_kv_heads=args.dense)
    try:
        hybrid.check_kv_heads(args.hkv)
    except ValueError as e:
        ap.error(f"--dense: {e}")
    g = args.hq // args.hkv
    qi = torch.tensor([j * g + i for j in sorted(args.dense) for i in range(g)], device=dev)
    ki = torch.tensor(sorted(args.dense), device=dev)
    rows = []
    print(f"{C.device_name(dev)}  {args.pattern} + dense kv heads {args.dense} "
          f"(Hq {args.hq}, Hkv {args.hkv}, D {args.dim}, bf16, fwd+bwd ms"
          f"{', CUDA graphs' if args.graphs else ''})")
    print(f"{'S':>7} {'sparse':>8} {'hybrid':>8} {'sdpa_slice':>10} {'sdpa':>8} "
          f"{'dense eff.':>10} {'hybrid/sdpa':>11}")
    for s in args.seq:
        mk = lambda h: torch.randn(1, h, s, args.dim, device=dev, dtype=torch.bfloat16,  # noqa: E731
                                   requires_grad=True)
        q, k, v = mk(args.hq), mk(args.hkv), mk(args.hkv)
        qs, ks, vs = (t.detach()[:, idx].clone().requires_grad_() for t, idx in
                      ((q, qi), (k, ki), (v, ki)))
        t_s = _fwd_bwd(lambda a, b, c: dilated_attention(a, b, c, sparse), q, k, v, args.graphs,
                       args.rep_ms)
        t_h = _fwd_bwd(lambda a, b, c: dilated_attention(a, b, c, hybrid), q, k, v, args.graphs,
                       args.rep_ms)
        sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,  # noqa: E731
                                                              enable_gqa=True)
        t_d = _fwd_bwd(sdpa, qs, ks, vs, args.graphs, args.rep_ms)
        t_f = _fwd_bwd(sdpa, q, k, v, args.graphs, args.rep_ms)
        eff = t_d / max(t_h - (1 - len(args.dense) / args.hkv) * t_s, 1e-9)
        rows.append(dict(gpu=C.device_name(dev), pattern=args.pattern,
                         dense=" ".join(map(str, args.dense)), seq=s, hq=args.hq, hkv=args.hkv,
                         dim=args.dim, graphs=args.graphs, sparse_ms=t_s, hybrid_ms=t_h,
                         sdpa_slice_ms=t_d, sdpa_ms=t_f, dense_efficiency=eff, hybrid_over_sdpa=t_h / t_f))
        print(f"{s:>7} {t_s:8.3f} {t_h:8.3f} {t_d:10.3f} {t_f:8.3f} {eff:10.2f} {t_h / t_f:11.2f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
