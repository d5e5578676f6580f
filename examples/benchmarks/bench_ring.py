"""Ring dilated attention across GPUs: correctness, weak scaling and the longest sequence (issue 6).

Launched once per world size; every mode also runs on one process without ``torchrun`` (world
size 1: no ring, the plain op), so the single-GPU baselines come from the same script::

    torchrun --nproc_per_node 8 examples/benchmarks/bench_ring.py --mode correctness
    torchrun --nproc_per_node 8 examples/benchmarks/bench_ring.py --mode scaling \\
        --tokens-per-gpu 32K,128K
    torchrun --nproc_per_node 8 examples/benchmarks/bench_ring.py --mode max-len
    python examples/benchmarks/bench_ring.py --mode scaling           # world size 1
    torchrun --nproc_per_node 2 examples/benchmarks/bench_ring.py --device cpu --mode correctness \\
        --seq-len 256 --heads 4 --kv-heads 2 --head-dim 16 --pattern pow2   # gloo smoke run

Modes (NCCL on CUDA, gloo with ``--device cpu``; see ``docs/multi_gpu.md``):

* ``correctness``: every rank draws the same full sequence (shared seed), computes a float32
  reference (``dilated_attention(..., backend="torch")`` on the bf16-rounded inputs; TF32 off) and
  the single-GPU bf16 op on the whole sequence, then runs ``ring_attention`` on its shard of each
  layout and compares *its* rows of out / dq / dk / dv. Max abs error (max over ranks) and
  relative Frobenius error (sums over ranks) for the ring and for the single-GPU op; ``ok`` when
  the ring's relative error is at most ``--tol-factor`` (2) × the single-GPU bf16 op's — the
  project's "within bf16 rounding of what one GPU does" rule.
* ``scaling``: fixed tokens per GPU ``T`` (total ``S = T·W``); fwd+bwd of one attention layer.
  ``ring ms``: median over ``--reps`` of the slowest rank's time (CUDA events, barrier before
  every rep, warm-up first). ``ring_attention`` reuses its send plan while positions are unchanged
  (the layers after the first in one forward), so timed calls are such layers; planning happens
  in the untimed first call.
  Two ideals, both fwd+bwd of ``dilated_attention`` on one GPU:
  ``full/W`` — the full sequence of ``S`` tokens on rank 0 alone, divided by ``W``: the same
  function with perfect parallelism (the honest ideal);
  ``shard`` — each rank's shard alone (its ``T`` tokens at their true positions, local pairs only,
  no communication; ``ring.local_attention``, i.e. the ring's own local step), slowest rank: the
  per-GPU compute without remote keys.
  ``% ideal = ideal / ring``. Bytes: every tensor this rank sends through
  ``torch.distributed.batch_isend_irecv`` in one forward and one backward (the functions are
  wrapped for one extra, untimed call), next to a dense ring that sends every K and V block to
  every other rank: forward ``2·(W−1)/W·S·Hkv·D·elt`` bytes (K and V, ``elt`` = dtype size),
  backward the same again plus dK/dV in float32 (as ``ring/comm.py`` sends them).
* ``max-len``: the largest total length ``S = T·W`` whose fwd+bwd runs on every rank: per-GPU
  ``T`` doubles from ``--max-len-start`` until a trial fails, then bisects down to
  ``--max-len-granularity``. Failures are agreed with an all_reduce before anything else runs, so
  one rank's OOM never leaves the others waiting. Each trial first allocates its inputs plus a
  headroom probe (the last good trial's extra memory, scaled by the length ratio, +10 %) and
  agrees on that, because an OOM *inside* the ring's point-to-point exchange cannot be recovered
  (a peer waits on a send that never comes): if one happens anyway the search stops there, and a
  rank stuck on NCCL ends at ``--timeout-s``.

Output (rank 0): ``<out-dir>/bench_ring_<mode>_<GPU name>.csv``; rows are keyed by world size and
shape, so runs at 1, 2, 4 and 8 GPUs accumulate into one file (a rerun replaces its own rows);
it is rewritten after every row, so a run cut short keeps what it measured.
``scaling`` also draws ``% of ideal`` vs world size (PNG) once the CSV holds two world sizes.
A markdown table of the whole CSV is printed at the end.
"""

from __future__ import annotations

import os

# Before torch.distributed starts: NVLink multicast (NVLS) off — the device machines' README asks
# for it, and symmetric memory must not try multicast either.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_hilbert_attn import DilatedPattern, dilated_attention  # noqa: E402
from hf_hilbert_attn.tools.benchmarks import common as C  # noqa: E402
from hf_hilbert_attn.ring import sequence_parallel_attention  # noqa: E402

from hf_hilbert_attn.ring import local_attention  # noqa: E402  (the shard-alone ideal)
from hf_hilbert_attn.sharding import LAYOUTS, resolve_layout, shard_positions  # noqa: E402

LAYOUT_CHOICES = tuple(LAYOUTS) + ("auto",)  # auto: contiguous when shards are whole segments

REPO = Path(__file__).resolve().parents[2]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("correctness", "scaling", "max-len")


# ============================================================================= distributed
@dataclass
class Dist:
    """Where this process stands: ``group`` is None when running alone (world size 1)."""

    rank: int
    world: int
    group: object
    device: torch.device
    comm_device: torch.device  # where collective tensors live (cuda for NCCL, cpu for gloo)
    backend: str  # "nccl", "gloo" or "none"
    owns_pg: bool  # this script created the process group (and destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_dist(device_arg: str, timeout_s: float) -> Dist:
    """Join the process group torchrun describes, reuse one that exists, or run alone."""
    want_cuda = device_arg.startswith("cuda")
    if want_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --device cpu (gloo)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs = dict(timeout=datetime.timedelta(seconds=timeout_s))
        if want_cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = device  # eager NCCL init, barrier knows its device
        dist.init_process_group("nccl" if want_cuda else "gloo", **kwargs)
        owns = True
    if dist.is_initialized():
        backend = dist.get_backend()
        comm = device if backend == "nccl" else torch.device("cpu")
        return Dist(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device, comm,
                    backend, owns)
    return Dist(0, 1, None, device, device, "none", False)


def allreduce(d: Dist, values: Sequence[float], op: str = "max") -> List[float]:
    """Element-wise max / min / sum of a few floats over the ranks (identity when alone)."""
    if d.group is None or d.world == 1:
        return [float(x) for x in values]
    t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=d.comm_device)
    dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                           "sum": dist.ReduceOp.SUM}[op], group=d.group)
    return t.tolist()


def sync(d: Dist) -> None:
    """Barrier plus device sync: every rank starts the next timed call together."""
    allreduce(d, [0.0])
    C.synchronize(d.device)


def agree(d: Dist, fn: Callable[[], object]) -> tuple:
    """Run ``fn`` on every rank, catch its error, and agree: ``(all_ok, reason)``.

    ``reason`` is decided by all ranks together, so every rank takes the same branch next:
    ``""``, ``"OOM (rank r)"`` or ``"error (rank r)[: message]"`` (the highest failing rank; its
    message where that is this rank — it is also logged there). Use only around work without
    collectives inside (or at the very start of one); a rank that fails halfway through a
    collective cannot be rescued by agreeing afterwards.
    """
    err = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported, then agreed on
        err = e
    code = 0 if err is None else (1 if C.is_oom(err) else 2)
    worst, who = (int(x) for x in allreduce(d, [code, d.rank if err is not None else -1], "max"))
    if worst == 0:
        return True, ""
    if err is not None and not C.is_oom(err):
        print(f"rank {d.rank}: {C.short_error(err, 400)}", file=sys.stderr, flush=True)
    if worst == 1:
        return False, f"OOM (rank {who})"
    text = f": {C.short_error(err, 120)}" if err is not None and who == d.rank else ""
    return False, f"error (rank {who}){text}"


def why(err: Optional[BaseException]) -> str:
    """One rank's own error (no agreement): ``"OOM"`` or the error's first line."""
    return "OOM" if C.is_oom(err) else C.short_error(err, 120)


def log(d: Dist, msg: str) -> None:
    if d.is_main:
        print(msg, file=sys.stderr, flush=True)


# ============================================================================= timing / bytes
def timed_ms(d: Dist, fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn`` (ms), barrier before each rep.

    CUDA events on GPUs, wall clock on CPU. ``fn`` has run once already (see :func:`agree`).
    """
    for _ in range(max(0, warmup - 1)):
        fn()
    times = []
    for _ in range(reps):
        sync(d)
        if d.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(allreduce(d, times, "max")))


class CommCounter:
    """Counts bytes this rank sends while active, split by phase (``counter.phase = "bwd"``).

    Wraps ``torch.distributed.batch_isend_irecv`` (sends: ``P2POp`` whose op is ``isend``) and
    ``all_gather`` (this rank's input, i.e. what it contributes; the ring all-gathers positions
    and a small descriptor per call), and ``all_to_all_single`` (head-sharded mode: its input
    but the chunk it keeps, counted with the point-to-point bytes). The library looks them up
    on the module at call time.
    """

    def __init__(self):
        self.phase = "fwd"
        self.p2p = {"fwd": 0, "bwd": 0}
        self.gathered = {"fwd": 0, "bwd": 0}

    def __enter__(self):
        self._orig = (dist.batch_isend_irecv, dist.all_gather, dist.all_to_all_single)
        orig_batch, orig_gather, orig_a2a = self._orig

        def batch_isend_irecv(p2p_op_list):
            for op in p2p_op_list:
                if getattr(op.op, "__name__", "") == "isend":
                    self.p2p[self.phase] += op.tensor.numel() * op.tensor.element_size()
            return orig_batch(p2p_op_list)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            self.gathered[self.phase] += tensor.numel() * tensor.element_size()
            return orig_gather(tensor_list, tensor, *args, **kwargs)

        def all_to_all_single(output, input, *args, **kwargs):  # (ulysses) all but own chunk
            world = dist.get_world_size(kwargs.get("group"))
            self.p2p[self.phase] += input.numel() * input.element_size() * (world - 1) // world
            return orig_a2a(output, input, *args, **kwargs)

        dist.batch_isend_irecv, dist.all_gather = batch_isend_irecv, all_gather
        dist.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_gather, dist.all_to_all_single = self._orig
        return False


def dense_ring_bytes(world: int, seq_len: int, batch: int, hkv: int, head_dim: int,
                     elt: int, grad_elt: int = 4) -> Dict[str, int]:
    """Bytes one rank sends per layer in a dense ring (every K/V block to every other rank).

    Forward: K and V, ``2·(W−1)/W·S·Hkv·D·elt``. Backward: K and V again plus dK and dV in
    ``grad_elt``-byte accumulators, the way ``ring/comm.py`` sends them (float32).
    """
    kv = (world - 1) * (seq_len // world) * batch * hkv * head_dim
    return {"fwd": 2 * kv * elt, "bwd": 2 * kv * elt + 2 * kv * grad_elt}


# ============================================================================= inputs / calls
def layout_label(layout: str, seq_len: int, world: int, pattern, sp_mode: str = "ring") -> str:
    """``"auto"`` names what it resolves to for this length (``"auto→contiguous"``); another
    mode than the ring goes in front (``"ulysses/contiguous"``)."""
    if layout == "auto":
        layout = f"auto→{resolve_layout(layout, seq_len, world, pattern)}"
    return layout if sp_mode == "ring" else f"{sp_mode}/{layout}"


def positions(d: Dist, seq_len: int, layout: str, pattern) -> torch.Tensor:
    """This rank's true positions ``[S / W]`` (int64, on the device) under ``layout``."""
    table = shard_positions(seq_len, d.world, layout, pattern)
    if table.numel() != seq_len:
        raise ValueError(f"layout {layout!r} cannot split {seq_len} tokens evenly over "
                         f"{d.world} ranks (it would pad to {table.numel()}); use a length that "
                         f"is a multiple of {2 * d.world}")
    return table[d.rank].to(d.device)


def local_inputs(args, d: Dist, tokens: int, seed: int):
    """Random ``q, k, v`` (leaves needing grad) and ``dout`` for ``tokens`` tokens on this rank."""
    gen = torch.Generator(device=d.device).manual_seed(seed * 1000 + d.rank)
    dt = DTYPES[args.dtype]

    def rnd(h):
        return torch.randn(args.batch, h, tokens, args.head_dim, generator=gen, device=d.device,
                           dtype=dt)

    q, k, v, do = rnd(args.heads), rnd(args.kv_heads), rnd(args.kv_heads), rnd(args.heads)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def ring_call(args, d: Dist, pattern, q, k, v, pos):
    """The sequence-parallel call of ``--sp-mode`` (the ring by default)."""
    return sequence_parallel_attention(q, k, v, pattern, group=d.group, mode=args.sp_mode,
                                       q_positions=pos, k_positions=pos,
                                       causal=not args.non_causal, backend=args.backend)


def local_call(args, pattern, q, k, v, pos, backend=None):
    return dilated_attention(q, k, v, pattern, causal=not args.non_causal, q_positions=pos,
                             k_positions=pos, backend=backend or args.backend)


def shard_call(args, pattern, q, k, v, pos):
    """The shard alone, computed as the ring computes its local step (per run of consecutive
    positions): the ring's per-GPU work without any remote key."""
    return local_attention(q, k, v, pattern, causal=not args.non_causal, q_positions=pos,
                           k_positions=pos, backend=args.backend)


def fwd_bwd(fn, leaves, dout, counter: Optional[CommCounter] = None):
    """One forward + backward of ``fn()``; gradients of ``leaves`` reset first."""
    for t in leaves:
        t.grad = None
    if counter is not None:
        counter.phase = "fwd"
    out = fn()
    if counter is not None:
        counter.phase = "bwd"
    out.backward(dout)
    return out


# ============================================================================= correctness
def _stats(got: torch.Tensor, want: torch.Tensor) -> List[float]:
    """``[max |got - want|, Σ (got - want)², Σ want²]`` in float64."""
    diff = got.detach().double() - want.detach().double()
    return [float(diff.abs().max()) if diff.numel() else 0.0, float((diff * diff).sum()),
            float((want.double() ** 2).sum())]


def run_correctness(args, d: Dist, pattern, pattern_name: str, rows: "Sink") -> "Sink":
    unit = 2 * d.world  # zigzag needs 2W chunks; contiguous / hilbert need W
    S = -(-args.seq_len // unit) * unit
    if S != args.seq_len:
        log(d, f"correctness: seq-len {args.seq_len} rounded up to {S} (a multiple of 2·W)")
    dt = DTYPES[args.dtype]
    gen = torch.Generator(device=d.device).manual_seed(args.seed)  # same data on every rank

    def rnd(h):
        return torch.randn(args.batch, h, S, args.head_dim, generator=gen, device=d.device).to(dt)

    q, k, v, do = rnd(args.heads), rnd(args.kv_heads), rnd(args.kv_heads), rnd(args.heads)
    natural = torch.arange(S, device=d.device)

    def full(x_dtype, backend):
        leaves = [t.detach().to(x_dtype).requires_grad_() for t in (q, k, v)]
        out = fwd_bwd(lambda: local_call(args, pattern, *leaves, natural, backend), leaves,
                      do.to(x_dtype))
        return [out.detach()] + [t.grad for t in leaves]

    log(d, f"correctness: float32 reference ({args.ref_backend}) and single-device {args.dtype} "
           f"op on S={S} (every rank)")
    ref = full(torch.float32, args.ref_backend)  # [out, dq, dk, dv], natural order
    one = full(dt, args.backend)
    names = ("out", "dq", "dk", "dv")
    single = {n: _stats(one[i], ref[i]) for i, n in enumerate(names)}
    for layout in args.layouts:
        pos = positions(d, S, layout, pattern)
        leaves = [t.index_select(2, pos).detach().requires_grad_() for t in (q, k, v)]
        out = fwd_bwd(lambda: ring_call(args, d, pattern, *leaves, pos), leaves,
                      do.index_select(2, pos))
        got = [out.detach()] + [t.grad for t in leaves]
        for i, n in enumerate(names):
            mine = _stats(got[i], ref[i].index_select(2, pos))
            vs_one = _stats(got[i], one[i].index_select(2, pos))
            mx = allreduce(d, [mine[0], vs_one[0]], "max")
            sums = allreduce(d, [mine[1], mine[2], vs_one[1], vs_one[2]], "sum")
            ring_rel = math.sqrt(sums[0] / max(sums[1], 1e-300))
            single_rel = math.sqrt(single[n][1] / max(single[n][2], 1e-300))
            ratio = ring_rel / single_rel if single_rel > 0 else (0.0 if ring_rel == 0 else math.inf)
            rows.add(dict(
                C.environment(d.device), mode="correctness", world_size=d.world,
                comm=d.backend, layout=layout_label(layout, S, d.world, pattern, args.sp_mode),
                pattern=pattern_name, seq_len=S, batch=args.batch,
                heads_q=args.heads, heads_kv=args.kv_heads, head_dim=args.head_dim,
                dtype=args.dtype, causal=not args.non_causal, tensor=n,
                ring_max_abs=mx[0], ring_rel=ring_rel, single_max_abs=single[n][0],
                single_rel=single_rel, ring_vs_single_rel=math.sqrt(sums[2] / max(sums[3], 1e-300)),
                ring_vs_single_max_abs=mx[1], ratio=ratio, ok=bool(ratio <= args.tol_factor)))
        log(d, f"  {layout}: " + ", ".join(
            f"{r['tensor']} ring {r['ring_rel']:.2e} / single {r['single_rel']:.2e}"
            for r in rows[-4:]))
    return rows


# ============================================================================= scaling
def _peak_reset(d: Dist):
    if d.device.type == "cuda":
        C.synchronize(d.device)
        torch.cuda.reset_peak_memory_stats(d.device)


def _peak_gib(d: Dist) -> Optional[float]:
    if d.device.type != "cuda":
        return None
    return allreduce(d, [torch.cuda.max_memory_allocated(d.device) / 2**30], "max")[0]


def _full_single_ms(args, device, pattern, S: int) -> float:
    """fwd+bwd ms of ``dilated_attention`` over the whole sequence (``S`` tokens) on ``device``."""
    solo = Dist(0, 1, None, device, device, "none", False)
    q, k, v, do = local_inputs(args, solo, S, args.seed + 7)
    natural = torch.arange(S, device=device)

    def fn():
        return fwd_bwd(lambda: local_call(args, pattern, q, k, v, natural), [q, k, v], do)

    fn()
    return timed_ms(solo, fn, args.warmup, args.reps)


def _time_full_on_rank0(args, d: Dist, pattern, S: int) -> tuple:
    """:func:`_full_single_ms` on rank 0 while the others wait: ``(ms or None, why)``; once per
    length and run (every mode compares with the same time)."""
    if S in _FULL_TIMES:
        return _FULL_TIMES[S]
    ms, err = None, ""
    if d.is_main:
        try:
            ms = _full_single_ms(args, d.device, pattern, S)
        except Exception as e:  # noqa: BLE001 - an OOM here is a result, not a crash
            err = why(e)
        C.free_memory(d.device)  # its tensors died with the call
    got = allreduce(d, [ms if ms is not None else (-1.0 if d.is_main else -2.0)], "max")[0]
    _FULL_TIMES[S] = (got if got >= 0 else None), err
    return _FULL_TIMES[S]


_FULL_TIMES: dict = {}  # S -> _time_full_on_rank0's result


def run_scaling(args, d: Dist, pattern, pattern_name: str, rows: "Sink") -> "Sink":
    for T in args.tokens_per_gpu:
        S = T * d.world
        if d.world == 1:
            full_ms, full_why = None, "same as shard (W=1)"
        else:
            log(d, f"scaling T={C.fmt_size(T)}: single-GPU full sequence S={C.fmt_size(S)} on rank 0")
            full_ms, full_why = _time_full_on_rank0(args, d, pattern, S)
        for layout in args.layouts:
            log(d, f"scaling T={C.fmt_size(T)} W={d.world} {layout}")
            row = dict(C.environment(d.device), mode="scaling", world_size=d.world, comm=d.backend,
                       layout=layout_label(layout, S, d.world, pattern, args.sp_mode),
                       pattern=pattern_name,
                       tokens_per_gpu=T, seq_len=S,
                       batch=args.batch, heads_q=args.heads, heads_kv=args.kv_heads,
                       head_dim=args.head_dim, dtype=args.dtype, causal=not args.non_causal,
                       reps=args.reps)
            tensors = {}

            def setup():
                pos = positions(d, S, layout, pattern)
                tensors.update(zip(("q", "k", "v", "do"), local_inputs(args, d, T, args.seed)))
                tensors["pos"] = pos

            ok, err = agree(d, setup)
            if not ok:
                rows.add(dict(row, error=f"inputs: {err}"))
                continue
            q, k, v, do, pos = (tensors[n] for n in ("q", "k", "v", "do", "pos"))
            leaves = [q, k, v]

            def shard():  # this rank's tokens alone: local pairs only, no communication
                return fwd_bwd(lambda: shard_call(args, pattern, q, k, v, pos), leaves, do)

            ok, err = agree(d, shard)
            shard_ms = timed_ms(d, shard, args.warmup, args.reps) if ok else None

            def ring():
                return fwd_bwd(lambda: ring_call(args, d, pattern, q, k, v, pos), leaves, do)

            _peak_reset(d)
            # A failure inside the ring's exchange may hang its peers (see the module docstring);
            # agreeing afterwards is all that can be done, and the process group timeout bounds it.
            ok_r, err_r = agree(d, ring)
            peak = _peak_gib(d)
            ring_ms = timed_ms(d, ring, args.warmup, args.reps) if ok_r else None
            if ok_r and args.profile:
                profile_ring(args, d, ring, f"T{C.fmt_size(T)}_W{d.world}_{layout}")
            sent = {"fwd": 0, "bwd": 0}
            gathered = {"fwd": 0, "bwd": 0}
            if ok_r and d.world > 1:
                with CommCounter() as cc:
                    fwd_bwd(lambda: ring_call(args, d, pattern, q, k, v, pos), leaves, do, cc)
                sent, gathered = cc.p2p, cc.gathered
            sent_max = allreduce(d, [sent["fwd"], sent["bwd"], gathered["fwd"]], "max")
            sent_sum = allreduce(d, [sent["fwd"], sent["bwd"]], "sum")
            dense = dense_ring_bytes(d.world, S, args.batch, args.kv_heads, args.head_dim,
                                     DTYPES[args.dtype].itemsize)
            ideal_full = full_ms / d.world if full_ms is not None else (
                shard_ms if d.world == 1 else None)
            row.update(
                ring_ms=ring_ms, shard_alone_ms=shard_ms, full_single_ms=full_ms,
                ideal_full_over_w_ms=ideal_full,
                pct_ideal_full=_pct(ideal_full, ring_ms), pct_ideal_shard=_pct(shard_ms, ring_ms),
                peak_gib=peak,
                bytes_fwd_mean=sent_sum[0] / d.world, bytes_bwd_mean=sent_sum[1] / d.world,
                bytes_fwd_max=sent_max[0], bytes_bwd_max=sent_max[1],
                dense_bytes_fwd=dense["fwd"], dense_bytes_bwd=dense["bwd"],
                pct_dense_fwd=_pct(sent_sum[0] / d.world, dense["fwd"]),
                pct_dense_bwd=_pct(sent_sum[1] / d.world, dense["bwd"]),
                allgather_bytes_max=sent_max[2],
                error="; ".join(x for x in (
                    "" if ok else f"shard alone: {err}",
                    "" if ok_r else f"ring: {err_r}",
                    "" if full_ms is not None or d.world == 1 else f"full single: {full_why}")
                    if x))
            rows.add(row)
            log(d, f"  ring {_f(ring_ms)} ms, shard alone {_f(shard_ms)} ms, full/W "
                   f"{_f(ideal_full)} ms; sent fwd {_mib(row['bytes_fwd_mean'])} / bwd "
                   f"{_mib(row['bytes_bwd_mean'])} MiB (dense {_mib(dense['fwd'])} / "
                   f"{_mib(dense['bwd'])})")
            q = k = v = do = leaves = None  # free before the next layout's inputs
            tensors.clear()
            C.free_memory(d.device)
    return rows


def profile_ring(args, d: Dist, ring: Callable[[], object], tag: str) -> None:
    """One more ring fwd+bwd under ``torch.profiler`` on every rank: the per-rank table of device
    and host time by op (kernels, NCCL, copies), sorted by device time, written to
    ``<out-dir>/profile_<tag>_rank<r>.txt``. Where a rank's step time goes: compute per kernel,
    waits in NCCL, launches."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync(d)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("ring_fwd_bwd"):
            ring()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = "self_cuda_time_total" if d.device.type == "cuda" else "self_cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    (out / f"profile_{tag}_rank{d.rank}.txt").write_text(text)
    if args.trace:  # the timeline: gaps between kernels (host-bound pieces), overlap with NCCL
        prof.export_chrome_trace(str(out / f"trace_{tag}_rank{d.rank}.json"))
    sync(d)


def _pct(num, den):
    if num is None or den is None or den <= 0:
        return None
    return 100.0 * num / den


def _f(x):
    return "–" if x is None else f"{x:.2f}"


def _mib(x):
    return "–" if x is None else f"{x / 2**20:.1f}"


# ============================================================================= max-len
def _trial(args, d: Dist, pattern, T: int, layout: str, probe_bytes: int, fake_oom: bool) -> dict:
    """fwd+bwd of the ring at ``T`` tokens per rank; all ranks agree on the outcome."""
    res = {"ok": False, "why": "", "s": None, "peak_gib": None, "extra": 0, "in_ring": False}
    tensors = {}

    def setup():
        if fake_oom:
            raise torch.cuda.OutOfMemoryError(f"simulated OOM at {T} tokens per rank "
                                              "(--fake-oom-tokens)")
        tensors["pos"] = positions(d, T * d.world, layout, pattern)
        tensors.update(zip(("q", "k", "v", "do"), local_inputs(args, d, T, args.seed)))
        if probe_bytes > 0:  # headroom for the ring itself, freed into the allocator's cache
            torch.empty(probe_bytes, dtype=torch.uint8, device=d.device)

    try:
        _peak_reset(d)
        before = torch.cuda.memory_allocated(d.device) if d.device.type == "cuda" else 0
        ok, err = agree(d, setup)
        if not ok:
            res["why"] = f"{err} (inputs + headroom)"
            return res
        q, k, v, do, pos = (tensors[n] for n in ("q", "k", "v", "do", "pos"))
        _peak_reset(d)
        base = torch.cuda.memory_allocated(d.device) if d.device.type == "cuda" else before
        sync(d)
        t0 = time.perf_counter()
        ok, err = agree(d, lambda: (fwd_bwd(lambda: ring_call(args, d, pattern, q, k, v, pos),
                                            [q, k, v], do), C.synchronize(d.device)))
        secs = allreduce(d, [time.perf_counter() - t0], "max")[0]
        if not ok:
            res.update(why=err, in_ring=True)
            return res
        if d.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(d.device)
            res["extra"] = int(allreduce(d, [peak - base], "max")[0])
            res["peak_gib"] = allreduce(d, [peak / 2**30], "max")[0]
        res.update(ok=True, s=secs)
        return res
    finally:
        tensors.clear()
        C.free_memory(d.device)


def run_max_len(args, d: Dist, pattern, pattern_name: str, rows: "Sink") -> "Sink":
    gran = args.max_len_granularity
    for layout in args.layouts:
        lo = hi = lo_res = None
        why_hi, stopped = "", ""
        last_T = last_extra = 0

        def attempt(T):
            probe = int(last_extra * T / last_T * 1.1) if last_T else 0
            fake = args.fake_oom_tokens is not None and T > args.fake_oom_tokens and (
                d.rank == (args.fake_oom_rank % d.world))
            r = _trial(args, d, pattern, T, layout, probe, fake)
            log(d, f"  max-len {layout} W={d.world} T={C.fmt_size(T)}/GPU "
                   f"(S={C.fmt_size(T * d.world)}): "
                   + (f"ok {r['s']:.2f} s" if r["ok"] else r["why"]))
            return r

        T = args.max_len_start
        while T <= args.max_len_cap:
            if lo_res is not None and lo_res["s"] * T / lo > args.max_len_trial_s:
                stopped = f"next trial predicted > {args.max_len_trial_s:.0f} s"
                break
            r = attempt(T)
            if not r["ok"]:
                hi, why_hi = T, r["why"]
                if r["in_ring"]:
                    stopped = "failure inside the ring: search stopped (peers' state unknown)"
                break
            lo, lo_res, last_T, last_extra = T, r, T, r["extra"]
            T *= 2
        else:
            stopped = f"reached --max-len-cap {C.fmt_size(args.max_len_cap)}/GPU"
        while (lo is not None and hi is not None and not stopped and hi - lo > gran
               and why_hi.startswith("OOM")):
            mid = (lo + hi) // 2 // gran * gran
            if mid <= lo or mid >= hi:
                break
            r = attempt(mid)
            if r["ok"]:
                lo, lo_res, last_T, last_extra = mid, r, mid, r["extra"]
            else:
                hi, why_hi = mid, r["why"]
                if r["in_ring"]:
                    stopped = "failure inside the ring: search stopped (peers' state unknown)"
        rows.add(dict(
            C.environment(d.device), mode="max-len", world_size=d.world, comm=d.backend,
            layout=layout, pattern=pattern_name, batch=args.batch, heads_q=args.heads,
            heads_kv=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
            causal=not args.non_causal,
            max_tokens_per_gpu=lo, max_total_len=None if lo is None else lo * d.world,
            max_total_str=C.fmt_size(lo * d.world) if lo else "none",
            first_fail_tokens_per_gpu=hi, fail_reason=why_hi, stopped=stopped,
            time_at_max_s=lo_res["s"] if lo_res else None,
            peak_gib_at_max=lo_res["peak_gib"] if lo_res else None))
        if stopped.startswith("failure inside"):
            break
    return rows


# ============================================================================= output
KEYS = {
    "correctness": ("gpu", "world_size", "layout", "pattern", "seq_len", "batch", "heads_q",
                    "heads_kv", "head_dim", "dtype", "causal", "tensor"),
    "scaling": ("gpu", "world_size", "layout", "pattern", "tokens_per_gpu", "batch", "heads_q",
                "heads_kv", "head_dim", "dtype", "causal"),
    "max-len": ("gpu", "world_size", "layout", "pattern", "batch", "heads_q", "heads_kv",
                "head_dim", "dtype", "causal"),
}
TABLES = {
    "correctness": [("W", "world_size", "{:d}"), ("layout", "layout", None), ("S", "seq_len", None),
                    ("tensor", "tensor", None), ("ring max abs", "ring_max_abs", "{:.2e}"),
                    ("ring rel", "ring_rel", "{:.2e}"), ("1-GPU max abs", "single_max_abs", "{:.2e}"),
                    ("1-GPU rel", "single_rel", "{:.2e}"), ("ring/1-GPU", "ratio", "{:.2f}"),
                    ("ring vs 1-GPU rel", "ring_vs_single_rel", "{:.2e}"), ("ok", "ok", None)],
    "scaling": [("T/GPU", "tokens_per_gpu", None), ("W", "world_size", "{:d}"),
                ("layout", "layout", None), ("ring ms", "ring_ms", "{:.2f}"),
                ("full/W ms", "ideal_full_over_w_ms", "{:.2f}"),
                ("% ideal (full/W)", "pct_ideal_full", "{:.0f}"),
                ("shard-alone ms", "shard_alone_ms", "{:.2f}"),
                ("% ideal (shard)", "pct_ideal_shard", "{:.0f}"),
                ("sent fwd MiB", "mib_fwd", "{:.4g}"), ("sent bwd MiB", "mib_bwd", "{:.4g}"),
                ("% dense fwd", "pct_dense_fwd", "{:.0f}"), ("% dense bwd", "pct_dense_bwd", "{:.0f}"),
                ("peak GiB", "peak_gib", "{:.1f}"), ("error", "error", None)],
    "max-len": [("W", "world_size", "{:d}"), ("layout", "layout", None),
                ("max S", "max_total_str", None), ("max S (tokens)", "max_total_len", "{:d}"),
                ("per GPU", "max_tokens_per_gpu", "{:d}"),
                ("first fail /GPU", "first_fail_tokens_per_gpu", "{:d}"),
                ("why", "fail_reason", None), ("stopped", "stopped", None),
                ("s at max", "time_at_max_s", "{:.2f}"), ("peak GiB", "peak_gib_at_max", "{:.1f}")],
}


def _parse_cell(text: str):
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def read_csv(path: Path) -> List[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: _parse_cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def merge_rows(old: List[dict], new: List[dict], keys: Sequence[str]) -> List[dict]:
    """``old`` without the rows ``new`` replaces (same key), then ``new``; sorted for reading."""
    def key(r):
        return tuple(str(r.get(k)) for k in keys)

    fresh = {key(r) for r in new}
    rows = [r for r in old if key(r) not in fresh] + list(new)
    order = [k for k in ("tokens_per_gpu", "seq_len", "layout", "world_size", "tensor") if k in keys]
    tensors = ("out", "dq", "dk", "dv")

    def sort_key(r):
        return tuple((0, tensors.index(r[k])) if k == "tensor" and r.get(k) in tensors
                     else (0, r[k]) if isinstance(r.get(k), (int, float))
                     else (1, str(r.get(k))) for k in order)

    return sorted(rows, key=sort_key)


def plot_scaling(rows: List[dict], path: Path, gpu: str) -> Optional[Path]:
    """% of the full/W ideal vs world size, one panel per tokens/GPU, one line per layout; None
    with fewer than 2 world sizes. (The shard-alone ideal stays in the CSV and table; runs
    before ``ring.local_attention`` existed measured it as one call over the shard's positions,
    which for a zigzag shard — two runs with a gap — is slower than the ring itself.)"""
    if len({r.get("world_size") for r in rows}) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({int(r["tokens_per_gpu"]) for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, T in zip(axes.flat, panels):
        for i, layout in enumerate(layouts):
            for key, style, label in (("pct_ideal_full", "-", ""),):
                pts = sorted((int(r["world_size"]), r[key]) for r in rows
                             if int(r["tokens_per_gpu"]) == T and r["layout"] == layout
                             and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            color=f"C{i}", label=layout)
        ax.axhline(100, color="grey", lw=0.8)
        ax.axhline(90, color="grey", lw=0.8, ls=":")  # the target
        ax.set_xscale("log", base=2)
        ax.set_title(f"{C.fmt_size(T)} tokens/GPU", fontsize=10)
        ax.set_xlabel("GPUs (world size)")
        ax.set_ylabel("% of ideal (1-GPU full sequence / W), fwd+bwd")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Ring dilated attention, weak scaling — {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


class Sink(list):
    """The rows of this run; rank 0 merges them into the mode's CSV after every row, so a run
    cut short (a timeout, a hang ended by ``--timeout-s``) keeps what it measured."""

    def __init__(self, args, d: Dist):
        super().__init__()
        self.d = d
        self.keys = KEYS[args.mode]
        self.path = C.output_paths(args.out_dir, "bench_ring_" + args.mode.replace("-", ""),
                                   d.device, args.tag)["csv"]
        self.old = read_csv(self.path) if d.is_main else []

    def add(self, row: dict) -> None:
        self.append(row)
        if self.d.is_main:
            C.write_csv(merge_rows(self.old, list(self), self.keys), self.path)


def report(args, d: Dist, rows: List[dict], pattern_name: str) -> Dict[str, Path]:
    """Rank 0: merge ``rows`` into the mode's CSV, draw the PNG, print the markdown table."""
    stem = "bench_ring_" + args.mode.replace("-", "")
    paths = C.output_paths(args.out_dir, stem, d.device, args.tag)
    merged = merge_rows(read_csv(paths["csv"]), rows, KEYS[args.mode])  # as Sink wrote it
    written = {"csv": paths["csv"]}
    if args.mode == "scaling":
        for r in merged:
            r["mib_fwd"] = None if r.get("bytes_fwd_mean") is None else r["bytes_fwd_mean"] / 2**20
            r["mib_bwd"] = None if r.get("bytes_bwd_mean") is None else r["bytes_bwd_mean"] / 2**20
        png = plot_scaling(merged, paths["png"], C.device_name(d.device))
        if png is not None:
            written["png"] = png
    first = rows[0] if rows else {}
    print(f"\n## bench_ring {args.mode} — {C.device_name(d.device)}, pattern {pattern_name}, "
          f"Hq={first.get('heads_q')} Hkv={first.get('heads_kv')} D={first.get('head_dim')} "
          f"{args.dtype}, this run W={d.world} ({d.backend}); all world sizes in the CSV:\n")
    print(C.markdown_table(merged, TABLES[args.mode]))
    if args.mode == "correctness":
        bad = [r for r in rows if not r["ok"]]
        print(f"\nring error within {args.tol_factor:g}× the single-GPU {args.dtype} error: "
              + ("yes, every layout and tensor" if not bad else "NO for " + ", ".join(
                  f"{r['layout']}/{r['tensor']} ({r['ratio']:.2f}×)" for r in bad)))
    print("\nwrote " + ", ".join(str(p) for p in written.values()))
    return written


# ============================================================================= CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = lambda s: [C.parse_size(x) for x in s.split(",") if x]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--pattern", default="longnet_lm", help="name in configs/ or a YAML path")
    p.add_argument("--layouts", type=words, default=list(LAYOUTS),
                   help=f"comma list of {','.join(LAYOUT_CHOICES)} (default: "
                        f"{','.join(LAYOUTS)})")
    p.add_argument("--heads", type=int, default=32, help="query heads Hq (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv (default 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--non-causal", action="store_true", help="bidirectional attention")
    p.add_argument("--sp-modes", type=words, default=["ring"],
                   help="comma list of ring, ulysses, hybrid, auto: the sequence-parallel modes "
                        "checked or timed one after the other (default ring; rows of another mode "
                        "name it in the layout column; hybrid: Ulysses within a node, see "
                        "docs/multi_gpu.md)")
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                   help="dilated_attention backend for the op and every ring block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="outputs/bench_ring")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a rank stuck in a collective ends after this")
    g = p.add_argument_group("correctness")
    g.add_argument("--seq-len", type=C.parse_size, default=C.parse_size("32K"),
                   help="total length (rounded up to a multiple of 2·W; default 32K)")
    g.add_argument("--ref-backend", choices=["torch", "triton"], default="torch",
                   help="backend of the float32 reference (torch: exact float32 matmuls; "
                        "Triton's float32 dot may use TF32)")
    g.add_argument("--tol-factor", type=float, default=2.0,
                   help="ok when ring rel error <= this x the single-GPU op's (default 2)")
    g = p.add_argument_group("scaling")
    g.add_argument("--tokens-per-gpu", type=sizes, default=sizes("32K,128K"),
                   help="comma list (default 32K,128K)")
    g.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    g.add_argument("--reps", type=int, default=10, help="timed calls; the median is reported")
    g.add_argument("--profile", action="store_true",
                   help="also profile one ring fwd+bwd per rank (profile_*_rank<r>.txt)")
    g.add_argument("--trace", action="store_true",
                   help="with --profile: also write each rank's Chrome trace (trace_*.json)")
    g = p.add_argument_group("max-len")
    g.add_argument("--max-len-start", type=C.parse_size, default=C.parse_size("128K"),
                   help="first tokens per GPU (default 128K)")
    g.add_argument("--max-len-cap", type=C.parse_size, default=C.parse_size("64M"),
                   help="largest tokens per GPU tried (default 64M)")
    g.add_argument("--max-len-granularity", type=C.parse_size, default=C.parse_size("16K"),
                   help="bisection stops at this many tokens per GPU (default 16K)")
    g.add_argument("--max-len-trial-s", type=float, default=120.0,
                   help="skip a trial predicted (time ∝ length) to run longer than this")
    g.add_argument("--fake-oom-tokens", type=C.parse_size, default=None,
                   help="testing: one rank raises OOM above this many tokens per GPU")
    g.add_argument("--fake-oom-rank", type=int, default=-1, help="testing: that rank (default last)")
    args = p.parse_args(argv)
    bad = [x for x in args.sp_modes if x not in ("ring", "ulysses", "hybrid", "auto")]
    if bad or not args.sp_modes:
        p.error(f"--sp-modes takes ring, ulysses, hybrid, auto; got {bad or args.sp_modes}")
    bad = [x for x in args.layouts if x not in LAYOUT_CHOICES]
    if bad:
        p.error(f"unknown --layouts {bad}; choose from {list(LAYOUT_CHOICES)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    d = init_dist(args.device, args.timeout_s)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
    torch.backends.cudnn.allow_tf32 = False
    pattern_name, pattern = C.load_pattern(args.pattern)
    try:
        log(d, f"bench_ring {args.mode}: W={d.world} ({d.backend}), {C.device_name(d.device)}, "
               f"pattern {pattern_name} {pattern.configs}")
        run = {"correctness": run_correctness, "scaling": run_scaling,
               "max-len": run_max_len}[args.mode]
        rows = Sink(args, d)
        for args.sp_mode in args.sp_modes:
            rows = run(args, d, pattern, pattern_name, rows)
        if d.is_main:
            report(args, d, rows, pattern_name)
        if d.group is not None:
            sync(d)
    finally:
        if d.owns_pg:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
