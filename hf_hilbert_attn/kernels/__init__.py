"""Triton kernels for dilated attention: forward (out + lse) and backward (dq, dk, dv).

The launchers :func:`dilated_fwd` / :func:`dilated_bwd` (``ops.py``'s custom ops) run the
runners :func:`fwd_runner` / :func:`bwd_runner` that ``ops.py``'s prepared calls keep. Design:
``docs/kernels.md``. This package imports neither transformers nor torch.distributed.
"""

from __future__ import annotations

import torch

from ..dense_heads import DENSE
from ..inputs import KERNEL_HEAD_DIMS as SUPPORTED_HEAD_DIMS  # the one list
from ..planning import for_ranges
from ._bwd import _dkdv_kernel, _dq_kernel
from ._calls import (  # noqa: F401 (_CALLS, _SMALL, _may_mix, ...: read here by tests and tools)
    _CALLS, _SMALL, BwdPlan, Call, FwdPlan, _blocks, _call_key, _check_target,
    _dense_skip, _dummy, _fill_skipped, _flags, _head_chunk, _head_runs, _head_split,
    _launch_row, _launch_table, _launches, _may_mix, _needs_pair_mask, _planned,
    _position_args, _positions, _prep, _skipped, _smem, _strided, _tiles,
    _trimmed, _union_args, kept_if_captured)
from ._common import Strided, _scales
from ._config import KernelConfig, _run, configure, configured, kernel_config, set_launch_hook
from ._fwd import _fwd_kernel
from . import _config
from ._launch import relaunch_kept
from ._plan import W_CAP, PositionPlan, fwd_max_registers, plan_positions

__all__ = ["dilated_fwd", "dilated_bwd", "fwd_runner", "bwd_runner", "plan_positions",
           "PositionPlan", "SUPPORTED_HEAD_DIMS",
           "KernelConfig", "kernel_config", "configure", "configured", "set_launch_hook"]


def plan_fwd(c: Call) -> FwdPlan:
    """The forward's launches of call ``c``: a pure function of it."""
    B, HQ, HKV, SQ, _, D = c.shape
    prio, launch, sinks = _launches(c.pattern, c.plan, c.causal)
    # merge: the caller's float32 result holds every head (one chunk; skipped heads stay as given)
    hch = HQ if c.merge else _head_chunk(HQ, B * SQ * D, len(launch), c.cfg)
    # the union test: the key tables (as in the backward) for launches that need the per-pair
    # mask, else the runtime loop
    keys, psz, utab = _union_args(prio, c.plan, c.device, any(ln.pair for ln in launch))
    smem = _smem(c.device, c.cfg)
    tiles = {(t, f): _blocks("fwd", D, c.dtype, smem, t, f, cfg=c.cfg)
             for t, f in ((False, False), (True, False), (False, True))}
    items, rows = [], []
    for h0, nh in _head_runs(HQ, HQ // HKV, c.skip, hch):
        for li, ln in enumerate(launch):
            last = li == len(launch) - 1
            lp = _trimmed(c, ln, c.merge, bool(sinks) and last)
            if lp is None:
                continue
            tab = utab if ln.pair else 0
            BM, BN, warps, stages = tiles[tab > 0, ln.npri == 0]
            seg0, nseg, blk0, nblk = _tiles(lp.qlo, lp.qhi, ln.w, ln.r, BM, True)
            ncls = 1 if c.pattern.query_dilation == "per_head" else ln.r
            rows.append(_launch_row(c, lp, ln, li, len(launch), h0, nh, (seg0, ncls, nblk, blk0),
                                    sinks, len(prio), psz, c.merge))
            kw = dict(BM=BM, BN=BN, D=D, F=_flags(c, prio, ln, BM, bool(sinks) and last, tab),
                      num_warps=warps, num_stages=stages)
            cap = fwd_max_registers((BM, BN, warps), ln.npri == 0)
            if cap and c.dtype != torch.float32 and not c.cfg.interpret:
                kw["maxnreg"] = cap
            items.append(((nseg * ncls * nblk, B * nh), kw))
    tables, items = _launch_table(prio, launch, keys, items, rows, c.device)
    return FwdPlan(tables, hch if len(launch) > 1 and not c.merge else 0, items)


def _call_plans(build, q, k, pattern, plan: PositionPlan, causal, scale, skip: tuple,
                flags: tuple, hbase: int, softcap: float):
    """``(configuration, sparse plan, dense plan or None, whether they were made just now, heads
    to fill, positions, the memo of their launches: ``_launch.launch_all``'s, and the positions'
    ``(lead, tail)``: ``_position_args``)`` of a call under :func:`kernel_config`, made once per
    call key: ``build`` (:func:`plan_fwd` / :func:`plan_bwd`) of the sparse pattern leaving out
    ``skip`` (and, where that adds no launch, the dense key/value heads: ``_head_split``) and of
    the plain causal config over the dense heads, whose launches come last (they overwrite what
    the sparse ones computed for them). ``flags``: ``Call``'s ``merge`` (and ``merge_kv``);
    ``hbase``, ``softcap``: its own."""
    (B, HQ, SQ, D), dev, cfg = q.shape, q.device, kernel_config()
    shape = (B, HQ, k.shape[1], SQ, k.shape[2], D)

    def make():
        sparse, left, fill = _head_split(pattern, skip, shape, cfg, any(flags))
        same = (plan, shape, q.dtype, dev, bool(causal), cfg)
        ranged = for_ranges(sparse, plan.qlo, plan.qhi, plan.klo, plan.khi, causal)
        dense = pattern.dense_kv_heads and build(Call(
            DENSE, *same, _dense_skip(pattern.dense_kv_heads, skip, shape[2]), softcap=softcap))
        return (build(Call(ranged, *same, left, *flags, hbase=hbase, softcap=softcap)),
                dense or None, fill, {})

    pos = _positions(plan, dev)
    key = _call_key(build.__name__, pattern, plan, q, k, causal, scale, cfg,
                    (skip, *flags, hbase, softcap))
    (sparse, dense, fill, memo), fresh = _planned(key, make, dev, pos)
    return cfg, sparse, dense, fresh, fill, pos, memo, *_position_args(plan, pos)


def dilated_fwd(q, k, v, pattern, scale: float, causal: bool, plan: PositionPlan, out=None,
                lse=None, skip: tuple = (), acc=None, head_base: int = 0, softcap: float = 0.0):
    """Forward launches. q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` → (out, lse float32 natural log),
    planned once per call key (:func:`plan_fwd`); the pattern's dense key/value heads: one more
    launch of the plain causal config over their heads. ``out`` / ``lse``: tensors to write
    into (unit last stride). ``skip``: key/value heads not computed (out 0, lse -inf). ``acc``: a float32
    result with its given ``lse`` over other keys (0, -inf at first) this call merges into (the
    ring's pieces; ``out`` not written). ``head_base``: query head ``h`` follows the pattern's
    rule as head ``head_base + h`` (a head-sharded rank's heads; dense heads: local indices).
    ``softcap`` > 0: every score ``s`` (scaled) is taken as ``softcap * tanh(s / softcap)``."""
    B, HQ, SQ, _ = q.shape
    for name, t, shape, dtype in (("acc", acc, q.shape, torch.float32), ("out", out, q.shape,
                                  q.dtype), ("lse", lse, q.shape[:3], torch.float32)):
        if t is not None:
            _check_target(name, t, shape, dtype)
    if SQ == 0:
        lse = torch.empty((B, HQ, 0), device=q.device, dtype=torch.float32) if lse is None else lse
        return (acc if acc is not None else torch.empty_like(q) if out is None else out), lse
    return fwd_runner(q, k, pattern, plan, causal, scale, skip, acc is not None, head_base,
                      softcap)(q, k, v, out, lse, acc)


def fwd_runner(q, k, pattern, plan: PositionPlan, causal: bool, scale: float, skip: tuple = (),
               merge: bool = False, head_base: int = 0, softcap: float = 0.0):
    """The forward of calls like this one (q's and k's shapes, dtype and device, and these
    arguments; ``Sq`` > 0), planned once per call key: ``run(q, k, v, out=None, lse=None,
    acc=None) -> (out, lse)`` launches it as :func:`dilated_fwd` says (``acc``, given exactly
    when ``merge``, in place of ``out``). A caller that repeats a call keeps its runner (ops'
    prepared calls): one lookup of its plans, not one per call, until ``run.stale()`` (the
    configuration it was planned under is no longer :func:`kernel_config`'s)."""
    cfg, fp, dense, fresh, fill, pos, memo, lead, tail = _call_plans(
        plan_fwd, q, k, pattern, plan, causal, scale, skip, (merge,), head_base, softcap)
    (B, HQ, SQ, D), dev, group = q.shape, q.device, q.shape[1] // k.shape[1]
    scales, fresh = _scales(scale, softcap), {0: fresh}  # (the first run compiles side by
    # side; dict.pop with a default: atomic, as threads may share a runner)
    hot = {}  # {0: (strides, launches)}: the last layout launched (layers of a step repeat it;
    # a dict: get and pop are atomic, as threads may share a runner)

    def run(q, k, v, out=None, lse=None, acc=None):
        kept_if_captured(dev, (fp, dense, pos))  # (a CUDA graph replays read them)
        q, k, v = _prep(q), _prep(k), _prep(v)
        out = q if merge else torch.empty_like(q) if out is None else out  # (merge: q stands
        # in for the unwritten out, so the kernels' output type stays q's)
        lse = torch.empty((B, HQ, SQ), device=dev, dtype=torch.float32) if lse is None else lse
        if not merge:  # (fp.hch: the heads of a float32 sum over launches; 0: none)
            _fill_skipped(fill, group, (out, 0.0), (lse, float("-inf")))
            acc = torch.empty((B, fp.hch, SQ, D), device=dev, dtype=torch.float32) \
                if fp.hch else out
        ts = (q, k, v, out, lse, acc)
        st, x = _quads(ts)
        # as the last call: its kernels
        if (last := hot.get(0)) is not None and last[0] == st and x is not None:
            relaunch_kept(last[1], (x[:6], (*x[:5], x[3])))
            return (acc if merge else out), lse
        sv, launches, which = tuple(_strided(t) for t in ts), [], []
        for i, (p, head) in enumerate(((fp, sv), (dense, (*sv[:5], sv[3])))):  # (the sparse
            if p is not None:  # launches merge in acc, the dense heads' write out)
                launches += [(_fwd_kernel, grid, (*head, *lead), (*tail, p.tables, row, *ints,
                                                                  scales), kw)
                             for grid, row, ints, kw in p.items]
                which += [i] * len(p.items)
        _keep(hot, st, x, lead, _run(launches, fresh.pop(0, False), cfg, memo), which)
        return (acc if merge else out), lse
    run.stale = lambda: kernel_config() is not cfg  # (configure() replaced it since)
    return run


def _quads(ts: tuple) -> tuple:
    """``(strides, quads)`` of a call's tensors ``ts``: their strides, and each as the values
    a ``Strided`` argument hands Triton's launcher (address, batch, head and row strides), or
    None where one is not 16-byte aligned (the kernels kept for the last call assumed so) or a
    launch hook takes the launches (``set_launch_hook``)."""
    st = tuple(t.stride() for t in ts)
    x = tuple((t.data_ptr(), *s[:3]) for t, s in zip(ts, st))
    return st, None if any(a[0] & 15 for a in x) or _config._LAUNCH_HOOK is not None else x


def _keep(hot: dict, st, x, lead, kept, which) -> None:
    """Keep in ``hot`` what ``launch_all`` kept for the launches of a call with strides ``st``
    (``which``: the head each launch takes), for the next call of that layout; nothing where
    the call passed position tables (read per call), was unaligned or bound every launch."""
    if kept is not None and x is not None and not lead:
        hot[0] = (st, [(*k, w) for k, w in zip(kept, which)])
    else:
        hot.pop(0, None)


def _sum_buffers(B, hch, kch, SQ, SK, D, device):
    """The backward's float32 sums over configs, dq's ``[B, hch, SQ, D]`` and dk's and dv's
    ``[B, kch, SK, D]``, in one workspace: every dq launch precedes every dk/dv launch on the
    stream, so the dk/dv sums reuse the dq sum's memory (docs/kernels.md)."""
    nq, nk = B * hch * SQ * D, B * kch * SK * D
    work = torch.empty(max(nq, 2 * nk), device=device, dtype=torch.float32)
    return (work[:nq].view(B, hch, SQ, D), work[:nk].view(B, kch, SK, D),
            work[nk:2 * nk].view(B, kch, SK, D))


def plan_bwd(c: Call) -> BwdPlan:
    """The backward's launches of call ``c``: a pure function of it."""
    B, HQ, HKV, SQ, SK, D = c.shape
    prio, launch, sinks = _launches(c.pattern, c.plan, c.causal)
    # heads per chunk of the float32 buffers (query / key-value heads; merge: the caller's dq)
    hch = HQ if c.merge else _head_chunk(HQ, B * SQ * D, len(launch), c.cfg)
    kv_merge = c.merge_kv and not sinks
    kch = HKV if kv_merge else _head_chunk(HKV, 2 * B * SK * D, len(launch), c.cfg)
    smem = _smem(c.device, c.cfg)
    dq_tiles = {p: _blocks("dq", D, c.dtype, smem, p, cfg=c.cfg) for p in (False, True)}
    kv_tiles = {f: _blocks("dkdv", D, c.dtype, smem, skips=f, cfg=c.cfg) for f in (False, True)}
    kBM, kBN = kv_tiles[False][:2]  # (both the same: the key tiles and _may_mix use kBN)
    # union test: the key tables hold the configs but the last (up to four earlier ones);
    # the sink launch (after all of them in priority), sliding windows and longer patterns
    # test the configs in a runtime loop (decisions.md, "One union test in a loop")
    keys, psz, utab = _union_args(prio, c.plan, c.device, not c.pattern.sliding)

    # dq: one program per query tile, as in the forward, a chunk of heads at a time (first:
    # the sink launch's dk/dv sums are needed by the dk/dv kernel)
    dq_items, rows = [], []
    for h0, nh in _head_runs(HQ, HQ // HKV, c.skip, hch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, c.merge, bool(sinks) and li == len(launch) - 1)
            if lp is None:
                continue
            BM, BN, warps, stages = dq_tiles[ln.pair]
            seg0, nseg, blk0, nblk = _tiles(lp.qlo, lp.qhi, ln.w, ln.r, BM, True)
            ncls = 1 if c.pattern.query_dilation == "per_head" else ln.r
            rows.append(_launch_row(c, lp, ln, li, len(launch), h0, nh, (seg0, ncls, nblk, blk0),
                                    sinks, len(prio), psz, c.merge))
            fl = _flags(c, prio, ln, BM, bool(sinks) and li == len(launch) - 1, utab)
            kw = dict(BM=BM, BN=BN, D=D, F=fl, num_warps=warps, num_stages=stages)
            dq_items.append(((nseg * ncls * nblk, B * nh), kw))
    # dk, dv: one program per key tile of one key/value head, a chunk of heads at a time
    kv_items = []
    for g0, ng in _head_runs(HKV, 1, c.skip, kch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, kv_merge, False)  # kv_merge: no sink key
            if lp is None:
                continue
            kseg0, knseg, kblk0, knblk = _tiles(lp.klo, lp.khi, ln.w, ln.r, kBN, ln.w == W_CAP)
            rows.append(_launch_row(c, lp, ln, li, len(launch), g0, ng,
                                    (kseg0, ln.r, knblk, kblk0), sinks, len(prio), psz, kv_merge))
            # (the sink keys' dk/dv sums: added by the first launch only; the flag's code
            # costs the others registers)
            fl = _flags(c, prio, ln, kBN, bool(sinks) and li == 0, utab)
            warps, stages = kv_tiles[fl.EARLIER and not fl.MIXED][2:]
            kw = dict(BM=kBM, BN=kBN, D=D, F=fl, num_warps=warps, num_stages=stages)
            kv_items.append(((knseg * ln.r * knblk, B * ng), kw))
    # (the dq launches, then the dk/dv launches)
    tables, items = _launch_table(prio, launch, keys, dq_items + kv_items, rows, c.device)
    dq_items, kv_items = items[:len(dq_items)], items[len(dq_items):]
    chunks = (0 if c.merge else hch, 0 if kv_merge else kch) if len(launch) > 1 else None
    return BwdPlan(tables, sinks, chunks, dq_items, kv_items, kv_merge,
                   bool(sinks) and (c.merge or len(launch) == 1))


def _bwd_heads(v, sg, none, lead=()) -> tuple:
    """The heads of the backward's launches — dq, dk/dv, then the dense heads' dq and dk/dv —
    from ``v``: the ``Strided`` arguments of ``q k v do lse delta out dq``, the float32 sums
    ``dq dk dv``, then ``dk dv`` and the lse gradient (or delta, unread), or their launcher
    values (``_quads``); ``sg`` the sink keys' sums, ``none`` an unused one, ``lead`` the
    position tables."""
    ins = v[:6]
    return ((*ins, v[7], v[8], sg, v[6], v[13], *lead),
            (*ins, v[11], v[12], v[9], v[10], sg, *lead),
            (*ins, v[7], v[7], none, v[6], v[13], *lead),
            (*ins, v[11], v[12], v[11], v[12], none, *lead))


def _with_dlse(kw: dict, dlse: bool) -> dict:
    """A launch's keywords for a call with an lse gradient (``dlse``): dq's ``HAS_DLSE``."""
    return dict(kw, F=kw["F"]._replace(HAS_DLSE=True)) if dlse else kw


def _bwd_stats(lse, B, HQ, SQ, dev):
    """``(lse, delta)`` rows ``[B, Hq, Sq]``, padded to a multiple of 16 (a small copy of lse):
    Triton specialises on strides dividing by 16; one compile serves every length."""
    if SQ % 16 == 0 and lse.is_contiguous():
        return lse, torch.empty((B, HQ, SQ), device=dev, dtype=torch.float32)
    stats = torch.empty((2, B, HQ, -(-SQ // 16) * 16), device=dev, dtype=torch.float32)
    stats[0, :, :, :SQ].copy_(lse)
    return stats[0, :, :, :SQ], stats[1, :, :, :SQ]


def dilated_bwd(do, q, k, v, out, lse, dlse, pattern, scale: float, causal: bool,
                plan: PositionPlan, dq=None, dk=None, dv=None, skip: tuple = (), dq_acc=None,
                dkv_acc=None, head_base: int = 0, softcap: float = 0.0):
    """Backward launches → (dq, dk, dv) in the input dtype (``dlse`` may be None), planned once per
    call key (:func:`plan_bwd`); dense key/value heads as in :func:`dilated_fwd`. ``dq``/``dk``/``dv``: tensors (or views) to write into; float32
    sums over configs hold a chunk of heads at a time (``_sum_buffers``). ``skip``: key/value
    heads not computed (zero gradients). ``dq_acc`` / ``dkv_acc``: float32 sums this call's dq /
    (dk, dv) add into (the ring's pieces; dk/dv in the kernels where no key is a sink);
    ``head_base`` and ``softcap`` as in :func:`dilated_fwd`."""
    for name, g, t, dtype in (("dq", dq, q, q.dtype), ("dk", dk, k, k.dtype),
                              ("dv", dv, v, v.dtype), ("dq_acc", dq_acc, q, torch.float32),
                              *zip(("dk_acc", "dv_acc"), dkv_acc or (), (k, v),
                                   (torch.float32,) * 2)):
        if g is not None:
            _check_target(name, g, t.shape, dtype)
    if q.shape[2] == 0 or k.shape[2] == 0:  # zero gradients (or the given sums)
        dq, dk, dv = (torch.zeros_like(t) if g is None else g.zero_()
                      for g, t in ((dq, q), (dk, k), (dv, v)))
        return (dq if dq_acc is None else dq_acc), *(dkv_acc or (dk, dv))
    return bwd_runner(q, k, pattern, plan, causal, scale, skip, dq_acc is not None,
                      dkv_acc is not None, head_base, softcap)(
        do, q, k, v, out, lse, dlse, dq, dk, dv, dq_acc, dkv_acc)


def bwd_runner(q, k, pattern, plan: PositionPlan, causal: bool, scale: float, skip: tuple = (),
               merge: bool = False, merge_kv: bool = False, head_base: int = 0,
               softcap: float = 0.0):
    """The backward of calls like this one (as :func:`fwd_runner`; ``Sq``, ``Sk`` > 0):
    ``run(do, q, k, v, out, lse, dlse=None, dq=None, dk=None, dv=None, dq_acc=None,
    dkv_acc=None) -> (dq, dk, dv)`` as :func:`dilated_bwd` says (``dq_acc`` given exactly when
    ``merge``, ``dkv_acc`` when ``merge_kv``)."""
    cfg, bp, dense, fresh, fill, pos, memo, lead, tail = _call_plans(
        plan_bwd, q, k, pattern, plan, causal, scale, skip, (merge, merge_kv), head_base,
        softcap)
    (B, HQ, SQ, D), (HKV, SK), dev = q.shape, k.shape[1:3], q.device
    scales, fresh = _scales(scale, softcap), {0: fresh}
    hot = {}  # as the forward's

    def run(do, q, k, v, out, lse, dlse=None, dq=None, dk=None, dv=None, dq_acc=None,
            dkv_acc=None):
        kept_if_captured(dev, (bp, dense, pos))
        q, k, v, out, do = _prep(q), _prep(k), _prep(v), _prep(out), _prep(do)
        dq = q if merge else torch.empty_like(q) if dq is None else dq  # (merge: q stands in
        # for the unwritten dq, so the kernels' output type stays q's)
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        _fill_skipped(() if merge else fill, HQ // HKV, (dq, 0.0))
        lse, delta = _bwd_stats(lse, B, HQ, SQ, dev)  # (delta: written by the dq launches)
        dl = dlse.contiguous() if dlse is not None else delta
        # The last dq launch also sums the sink keys' dk/dv (float32, atomically, over its
        # query tiles; the first dq launch zeroes them, or they start as zeros); the first dk/dv
        # launch adds them in. The dense heads' launches (one per kernel) write the results in
        # the input dtype and have no sink key.
        sinkg = (torch.zeros if bp.zero_sinks else torch.empty)(
            (B, HKV, 2 * bp.sinks, D), device=dev, dtype=torch.float32) if bp.sinks \
            else _dummy(dev)
        if not bp.kv_merge:
            _fill_skipped(fill, 1, (dk, 0.0), (dv, 0.0))
        dqacc, dkacc, dvacc = (dq, dk, dv) if bp.chunks is None else \
            _sum_buffers(B, *bp.chunks, SQ, SK, D, dev)  # (None: one launch per kernel, no sums)
        dqacc = dq_acc if merge else dqacc
        if bp.kv_merge:  # dk, dv: not written (k, v stand in, as q for dq)
            (dkacc, dvacc), dk, dv = dkv_acc, k, v
        ts = (q, k, v, do, lse, delta, out, dq, dqacc, dkacc, dvacc, dk, dv, dl, sinkg)
        st, x = _quads(ts)
        st = (st, dlse is None, do.dtype)
        # as the last call: its kernels
        if (last := hot.get(0)) is not None and last[0] == st and x is not None:
            none = (_dummy(dev).data_ptr(), 0, 0, 0)
            relaunch_kept(last[1], _bwd_heads(x, x[14] if bp.sinks else none, none))
        else:
            none = Strided(_dummy(dev), 0, 0, 0)
            heads = _bwd_heads(tuple(_strided(t) for t in ts[:14]),
                               _strided(sinkg) if bp.sinks else none, none, lead)
            launches, which = [], []
            for i, p in enumerate((bp, dense)):
                for kernel, items, j in ((_dq_kernel, p.dq_items, 2 * i),
                                         (_dkdv_kernel, p.kv_items, 1 + 2 * i)) if p else ():
                    launches += [(kernel, grid, heads[j], (*tail, p.tables, row, *ints, scales),
                                  _with_dlse(kw, dlse is not None and kernel is _dq_kernel))
                                 for grid, row, ints, kw in items]
                    which += [j] * len(items)
            # (dq with an lse gradient and without: two kernels, the same heads' guards)
            _keep(hot, st, x, lead, _run(launches, fresh.pop(0, False), cfg,
                                         memo.setdefault(dlse is not None, {})), which)
        if dkv_acc is not None and not bp.kv_merge:  # sink keys here: the sums on the host
            dkv_acc[0].add_(dk), dkv_acc[1].add_(dv)
        return (dq_acc if merge else dq), *(dkv_acc or (dk, dv))
    run.stale = lambda: kernel_config() is not cfg  # (configure() replaced it since)
    return run
