"""Host (CPU) time and launches per attention call: what a short sequence pays besides the kernels.

    python examples/benchmarks/host_overhead.py                  # on a GPU: real launches
    python examples/benchmarks/host_overhead.py --stub           # any machine: launches stubbed
    python examples/benchmarks/host_overhead.py --stub --profile # where the host time goes

One call of ``dilated_attention`` as a model layer makes it (default: SmolLM2-135M's heads, 9
query / 3 key-value heads of 64, bf16, S = 8192, the default pattern), forward with autograd
recording, then its backward. Printed per call, forward and backward:

* ``host_us``: wall time of the Python that plans and enqueues the call. On a GPU the call runs
  for real and is timed without a synchronisation (``--calls`` calls are fewer launches than
  the launch queue holds, so the host never waits for the GPU); ``--stub`` replaces each Triton
  kernel by a stub that runs the JIT's argument binding and cache-key step (what
  ``JITFunction.run`` does on the host before the driver call) and launches nothing, on CPU
  tensors.
* ``gpu_us`` (GPU only): the kernels' time from CUDA events, and ``wall_us`` the synchronised
  time per call: a call is host-bound when ``host_us`` is close to ``wall_us``.
* ``triton``: Triton kernel launches (``relaunch``: a layout launched before, through Triton's
  C launcher); ``torch_ops``: other device work the call issues (fills, copies, ``arange`` ...:
  each one more launch on a GPU; allocations are not counted).

Host times vary with the machine: compare before / after in one run on one machine.
"""

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

_NOT_WORK = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
             "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand", "unsqueeze",
             "squeeze", "slice", "select", "detach", "alias", "lift_fresh", "_to_copy_noop",
             "clone_noop", "is_same_size", "_reshape_alias", "reshape", "contiguous",
             "resize", "set", "record_stream", "_local_scalar_dense_noop"}


def _count_ops(fn):
    """``(result, Counter of ATen operators doing device work)`` of ``fn()``: the innermost ATen
    calls of a profile (inside our custom ops too), views and allocations left out; on a GPU
    also the number of CUDA kernels and memsets it ran (``gpu``)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        res = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ops = Counter()

    def work(e):  # name of an operator doing work itself (not through a nested one), or None
        name = e.name[6:].rstrip("_") if e.name.startswith("aten::") else None
        return None if name in _NOT_WORK else name

    def visit(e):  # counts e or the operators under it; whether any was counted
        below = [visit(c) for c in e.cpu_children]
        if any(below):
            return True
        name = work(e)
        if name:
            ops[name] += 1
        return bool(name)

    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            ops["gpu"] += 1
        elif e.cpu_parent is None:
            visit(e)
    return res, ops


class _Stub:
    """Stands for a Triton kernel: ``kernel[grid](...)`` runs the JIT's host-side binding and
    cache-key step (as ``JITFunction.run``), counts, and launches nothing."""

    def __init__(self, fn, counts, bind: bool):
        self.fn, self.counts, self.bind = fn, counts, bind
        self._binder = None
        self._keys = {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counts[self.fn.__name__] += 1
            if self.bind:
                if self._binder is None:
                    from triton.backends.compiler import GPUTarget
                    from triton.compiler import make_backend
                    from triton.runtime.jit import create_function_from_signature

                    backend = make_backend(GPUTarget("cuda", 90, 32))
                    self._binder = create_function_from_signature(self.fn.signature,
                                                                  self.fn.params, backend)
                _, specialization, options = self._binder(*args, **kwargs)
                key = (tuple(specialization), str(options))
                self._keys.setdefault(key, str(specialization) + str(options))
        return launch


def _relaunches(counts, fn):
    """``fn()``, counting in ``counts["relaunch"]`` the launches a runner repeats through
    Triton's C launcher (``kernels._launch.relaunch``: a layout launched before), which the
    kernels' wrappers below never see."""
    from hf_hilbert_attn.kernels import _launch

    n0 = getattr(_launch, "fast_launches", 0)  # (older trees in an A/B run: none)
    out = fn()
    if n := getattr(_launch, "fast_launches", 0) - n0:
        counts["relaunch"] += n
    return out


class _Launches:
    """Within the block, Triton launches are counted per kernel (``stub``: and not made)."""

    def __init__(self, stub: bool, bind: bool = True):
        import hf_hilbert_attn.kernels as kernels
        from hf_hilbert_attn.kernels import _bwd, _fwd

        self.counts = Counter()
        # each kernel where its launcher reads it: the kernel's module (older trees in an A/B
        # run: the package, and a delta pass where the kernels have one)
        self.slots = [(m, n) for m in (kernels, _fwd, _bwd)
                      for n in ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel")
                      if n in vars(m)]
        self.stub, self.bind = stub, bind

    def __enter__(self):
        self.saved = {(m, n): getattr(m, n) for m, n in self.slots}
        for (m, n), fn in self.saved.items():
            setattr(m, n, _Stub(fn, self.counts, self.bind) if self.stub
                    else _Counting(fn, self.counts))
        if self.stub:
            # CPU tensors take the (stubbed) kernels: the op's dispatch refuses them without
            # TRITON_INTERPRET=1, which main() clears so the launchers plan the GPU's tiles
            import hf_hilbert_attn.ops as ops

            self.use_triton = ops.use_triton
            ops.use_triton = lambda q, a, backend, real=self.use_triton: (
                backend == "triton" or real(q, a, backend))
        return self

    def __exit__(self, *exc):
        for (m, n), fn in self.saved.items():
            setattr(m, n, fn)
        if self.stub:
            import hf_hilbert_attn.ops as ops

            ops.use_triton = self.use_triton


class _Counting:
    def __init__(self, fn, counts):
        self.fn, self.counts = fn, counts

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def counted(*args, **kwargs):
            self.counts[self.fn.__name__] += 1
            return launch(*args, **kwargs)
        return counted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hq", type=int, default=9)
    p.add_argument("--hkv", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--pattern", default="default", help="a shipped name or a YAML path")
    p.add_argument("--stub", action="store_true",
                   help="no GPU: CPU tensors, kernels replaced by stubs that launch nothing")
    p.add_argument("--no-bind", action="store_true",
                   help="with --stub: skip the JIT's argument binding in the stubs")
    p.add_argument("--calls", type=int, default=20, help="timed calls per repeat")
    p.add_argument("--repeats", type=int, default=15, help="repeats; the best is printed")
    p.add_argument("--profile", action="store_true", help="print the top host functions")
    p.add_argument("--layers", action="store_true",
                   help="GPU: host time per layer of the call (op, kernels entry, launches, "
                        "Triton's launch alone, guard, allocation; SDPA's forward beside)")
    args = p.parse_args(argv)
    if args.stub:
        os.environ.pop("TRITON_INTERPRET", None)  # the launchers plan the real GPU tiles
        torch.set_num_threads(1)  # CPU tensor ops stand for launches: no thread-pool waits
    elif not torch.cuda.is_available():
        p.error("no CUDA GPU here: pass --stub to time the host path with stubbed launches")

    from hf_hilbert_attn import dilated_attention
    from hf_hilbert_attn.patterns import as_pattern

    pattern = as_pattern(args.pattern)
    dev = "cpu" if args.stub else "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shape_q = (args.batch, args.hq, args.seq, args.dim)
    shape_k = (args.batch, args.hkv, args.seq, args.dim)
    mk = torch.empty if args.stub else torch.randn  # stubbed kernels read nothing
    q = mk(shape_q, device=dev, dtype=dtype).requires_grad_()
    k = mk(shape_k, device=dev, dtype=dtype).requires_grad_()
    v = mk(shape_k, device=dev, dtype=dtype).requires_grad_()
    g = torch.ones(shape_q, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def fwd():
        return dilated_attention(q, k, v, pattern, backend="triton")

    def bwd(o):
        # q, k, v stand for a layer's projections: nothing accumulates into leaf gradients
        return torch.autograd.grad(o, (q, k, v), g)

    stubs = _Launches(True, not args.no_bind) if args.stub else _nullctx()
    with stubs:
        # warm up (compiles on a GPU, fills caches), then count one call's launches and ops
        for _ in range(3):
            bwd(fwd())
        sync()
        counter = stubs if args.stub else _Launches(False)
        counts = {}
        with counter if not args.stub else _nullctx():
            counter.counts.clear()
            o, ops = _relaunches(counter.counts, lambda: _count_ops(fwd))
            counts["forward"] = (dict(counter.counts), ops)
            counter.counts.clear()
            _, ops = _relaunches(counter.counts, lambda: _count_ops(lambda: bwd(o)))
            counts["backward"] = (dict(counter.counts), ops)
        del o
        sync()

        # timing: the median over repeats of the mean time per call
        res = {k: [] for k in ("forward", "backward", "wall_f", "wall_b", "gpu_f", "gpu_b")}
        for _ in range(args.repeats):
            outs = []
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                outs.append(fwd())
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            res["forward"].append((t1 - t0) / args.calls * 1e6)
            res["wall_f"].append((t2 - t0) / args.calls * 1e6)
            t0 = time.perf_counter()
            for o in outs:
                bwd(o)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            res["backward"].append((t1 - t0) / args.calls * 1e6)
            res["wall_b"].append((t2 - t0) / args.calls * 1e6)
            del outs, o
        if dev == "cuda":
            for _ in range(args.repeats):
                e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                e[0].record()
                o = fwd()
                e[1].record()
                bwd(o)
                e[2].record()
                sync()
                res["gpu_f"].append(e[0].elapsed_time(e[1]) * 1e3)
                res["gpu_b"].append(e[1].elapsed_time(e[2]) * 1e3)

    med = {k: min(v) if v else None for k, v in res.items()}  # best repeat: least disturbed
    mode = "stub (CPU, no launches)" if args.stub else torch.cuda.get_device_name()
    print(f"host overhead per call, {mode}: S={args.seq} B={args.batch} Hq={args.hq} "
          f"Hkv={args.hkv} D={args.dim} {args.dtype}, pattern {args.pattern} ({pattern})")
    print("| phase | host_us | wall_us | gpu_us | triton launches | torch ops |")
    print("|---|---|---|---|---|---|")
    for phase, h, w, gk in (("forward", "forward", "wall_f", "gpu_f"),
                            ("backward", "backward", "wall_b", "gpu_b")):
        launches, ops = counts[phase]
        fmt = lambda x: "-" if x is None else f"{x:.0f}"
        print(f"| {phase} | {fmt(med[h])} | {fmt(med[w] if dev == 'cuda' else None)} | "
              f"{fmt(med[gk])} | {sum(launches.values())} "
              f"({', '.join(f'{n.strip(chr(95))} {c}' for n, c in sorted(launches.items()))}) | "
              f"{sum(ops.values())} ({', '.join(f'{n} {c}' for n, c in sorted(ops.items()))}) |")
    if args.layers and dev == "cuda":
        _print_layers(q, k, v, g, pattern, fwd, bwd, args.calls, args.repeats)
    if args.profile:
        with _Launches(True, not args.no_bind) if args.stub else _nullctx():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                bwd(fwd())
            prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    return med


def _per_call_us(fn, calls: int, repeats: int) -> float:
    """Best over ``repeats`` of the mean host time of ``calls`` calls of ``fn`` (no sync
    inside: the GPU queue absorbs the work; without a GPU, plain host time). The bench scripts
    under ``docs/bench/speed/`` time with it too."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    sync()
    return best


def _print_layers(q, k, v, g, pattern, fwd, bwd, calls, repeats):
    """Host time of each layer of one attention call, outermost first: where the host time of
    a short step goes on this machine (each layer includes the ones below it)."""
    from hf_hilbert_attn.inputs import check_inputs
    from hf_hilbert_attn.kernels import _bwd, _fwd, _launch, dilated_bwd, dilated_fwd
    from hf_hilbert_attn.kernels._plan import plan_positions
    from triton.runtime.driver import driver

    if pattern.dense_kv_heads:  # the kernel layers below: the sparse call's (its heads all)
        print("\n(dense key/value heads: the kernel layers are the sparse part's, over every "
              "head; the op's own rows include the dense heads' call)")
        pattern = pattern.sparse_part
    a = check_inputs(q, k, v, pattern)
    plan, _ = plan_positions(a, pattern)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = dilated_fwd(qd, kd, vd, pattern, a.scale, True, plan)
    captured, real_run = [], _fwd._run
    for m in (_fwd, _bwd):  # the run step's input
        m._run = lambda launches, fresh, cfg, memo=None: captured.append((launches, memo))
    try:
        dilated_fwd(qd, kd, vd, pattern, a.scale, True, plan)
        dilated_bwd(g, qd, kd, vd, out, lse, None, pattern, a.scale, True, plan)
    finally:
        _fwd._run = _bwd._run = real_run
    (lf, mf), (lb, mb) = captured

    def triton_only(ls, memo):  # what launch_all() does after its memo's hit, prepared:
        # Triton's part
        dev = driver.active.get_current_device()
        kept = _launch.launch_all(ls, memo)
        prepared = [(kernel, *grid, (*_launch._addresses(head)[1], *tail))
                    for (kernel, grid, tail), (_, _, head, _, _) in zip(kept, ls)]

        def go():
            stream = driver.active.get_current_stream(dev)
            for kernel, g0, g1, g2, values in prepared:
                kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                           None, None, *values)
        return go

    def sdpa():  # what Transformers' sdpa layer calls (causal, key/value heads shared; its
        # backward is not timed alone: with enable_gqa it takes the math path, GPU-bound)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)

    rows = [
        ("op forward (autograd)", lambda: fwd(), 1),
        ("op backward (autograd)", None, 1),
        ("check_inputs", lambda: check_inputs(q, k, v, pattern), 1),
        ("kernels.dilated_fwd", lambda: dilated_fwd(qd, kd, vd, pattern, a.scale, True, plan), 1),
        ("kernels.dilated_bwd", lambda: dilated_bwd(g, qd, kd, vd, out, lse, None, pattern,
                                                    a.scale, True, plan), 1),
        ("launches, forward", lambda: _launch.launch_all(lf, mf), len(lf)),
        ("launches, backward", lambda: _launch.launch_all(lb, mb), len(lb)),
        ("Triton's launch alone, forward", triton_only(lf, mf), len(lf)),
        ("Triton's launch alone, backward", triton_only(lb, mb), len(lb)),
        ("guard and addresses of a forward's tensors", lambda: _launch._addresses(lf[0][2]), 1),
        ("torch.empty_like(q) on the GPU", lambda: torch.empty_like(qd), 1),
        ("SDPA forward (autograd), same shape", sdpa, 1),
    ]
    print(f"\nhost time per layer (us per call; launches: per launch in brackets), "
          f"{torch.cuda.get_device_name()}")
    print("| layer | us per call | launches | us per launch |")
    print("|---|---|---|---|")
    for name, fn, n in rows:
        if fn is None:  # the backward consumes one forward's graph per call
            outs = [fwd() for _ in range(calls)]
            it = iter(outs)
            us = _per_call_us(lambda: bwd(next(it)), calls, 1)
        else:
            us = _per_call_us(fn, calls, repeats)
        print(f"| {name} | {us:.1f} | {n} | {us / n:.1f} |")


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
    sys.exit(0)
