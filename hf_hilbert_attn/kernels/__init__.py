"""Triton kernels for dilated attention: forward (out + lse) and backward (dq, dk, dv).

The launchers :func:`dilated_fwd` / :func:`dilated_bwd` are what ``ops.py`` wraps in
``torch.library`` custom ops (differentiable there). Design and measurements:
``docs/kernels.md``. This package imports neither transformers nor torch.distributed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import triton

from ..inputs import KERNEL_HEAD_DIMS as SUPPORTED_HEAD_DIMS  # the one list
from ..plan_cache import kept
from ..planning import class_uniform, config_meets, for_ranges, nests, sink_keys
from ._bwd import _delta_kernel, _dkdv_kernel, _dq_kernel
from ._common import _SCALARS, LAUNCH_FIELDS, LAUNCH_ROW, Flags, Positions, Strided
from ._config import KernelConfig, _run, configure, configured, kernel_config, set_launch_hook
from ._common import LOG2E as _LOG2E
from ._fwd import _fwd_kernel
from ._plan import (W_CAP, PositionPlan, bwd_blocks, config_order, dkdv_blocks, fwd_blocks,
                    fwd_max_registers, plan_positions, union_keys)

__all__ = ["dilated_fwd", "dilated_bwd", "plan_positions", "PositionPlan", "SUPPORTED_HEAD_DIMS",
           "KernelConfig", "kernel_config", "configure", "configured", "set_launch_hook"]

LOG2E = float(_LOG2E.value)  # the kernels take scale * log2(e): softmax in base 2
def _earlier(npri: int) -> bool:
    """Compile-time flag: does any config come before the launch in priority order? Without,
    it compiles without the union code (no spills on sm_90, 18 % faster; docs/decisions.md)."""
    return npri > 0


def _smem(device, cfg: KernelConfig) -> Optional[int]:
    """Shared memory per program (opt-in maximum, bytes) of ``device``; None off CUDA."""
    if cfg.smem is not None or device.type != "cuda":
        return cfg.smem
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        _SMEM[idx] = getattr(torch.cuda.get_device_properties(idx),
                             "shared_memory_per_block_optin", None)
    return _SMEM[idx]


_SMEM: dict = {}


def _blocks(kind, d, dtype, smem=None, pair=False, first=False, skips=False, cfg=None):
    """The tile of ``kind`` (the configuration's override first) for a launch that tests the
    union rule pair by pair (``pair``: forward through the key tables, see
    ``_needs_pair_mask``), has no earlier config (``first``, forward) or has earlier ones but
    no program that needs the per-pair mask (``skips``, dk/dv; ``_may_mix``)."""
    cfg = kernel_config() if cfg is None else cfg
    if kind == "fwd":
        bm, bn, warps, stages = fwd_blocks(d, dtype, cfg.interpret, pair, first)
    elif kind == "dq":
        bm, bn, warps, stages = bwd_blocks(d, dtype, cfg.interpret, smem, pair)
    else:
        bm, bn, warps, stages = dkdv_blocks(d, dtype, cfg.interpret, smem, skips)
    over = cfg.tile_override(kind, first)
    if over is not None:
        bm, bn = over[:2]
        if len(over) > 2:
            warps, stages = over[2:]
    return bm, bn, warps, stages


_SMALL: dict = {}  # small int32 device tensors by (content, device): made once, never per call


def _small_tensor(values: tuple, device) -> torch.Tensor:
    """A cached int32 tensor on ``device`` (made per call: a host-to-device copy, uncapturable)."""
    key = (values, str(device))
    t = _SMALL.get(key)
    if t is None:
        if len(_SMALL) > 256:
            _SMALL.clear()
        t = _SMALL[key] = kept(lambda: torch.tensor(values, device=device, dtype=torch.int32),
                               device)
    return t


def _dummy(device):
    return _small_tensor((0,), device)


class _Launch(NamedTuple):
    """One launch: tiling segment (sliding: ``W_CAP``), rate, band reach in class steps, configs
    before it, its ``(w, r)`` for ``_participates``, per-pair union test (``_needs_pair_mask``)."""

    w: int
    r: int
    lb: int
    npri: int
    entry: tuple
    pair: bool


def _launches(pattern, plan: PositionPlan, causal: bool = True):
    """``(priority configs, launches in order, sinks)``: the config covering every query last
    (it writes the result and takes the sink keys: ``sinks`` > 0 when a key of this call is one),
    others only where they join a query and a key of this call (``planning.config_meets``)."""
    prio, order = config_order(pattern)
    out = []
    q_rng, k_rng = (plan.qlo, plan.qhi), (plan.klo, plan.khi)
    for i, (w, r) in enumerate(order):
        if i < len(order) - 1 and not config_meets(w, pattern.sliding, causal, q_rng, k_rng):
            continue
        npri = prio.index((w, r))
        if pattern.sliding:
            out.append(_Launch(W_CAP, r, (w - 1) // r, npri, (w, r), False))
        else:
            out.append(_Launch(w, r, 0, npri, (w, r), _needs_pair_mask(prio[:npri], r)))
    return prio, out, sink_keys(pattern, plan.klo, plan.base)


def _cfg_tensor(cfgs, device):
    return _small_tensor(tuple(x for wr in cfgs for x in wr) or (1, 1), device)


def _seg_range(lo: int, hi: int, w: int):
    s0 = lo // w
    return s0, hi // w - s0 + 1


def _query_tiles(plan: PositionPlan, w: int, r: int, bm: int):
    """(first segment, segments, first block, blocks per segment and class) of the query tiles:
    a short query range inside one segment (decoding) gets only the blocks that can hold it."""
    seg0, nseg = _seg_range(plan.qlo, plan.qhi, w)
    nblk = triton.cdiv(triton.cdiv(w, r), bm)
    if nseg == 1:
        lo = max(0, plan.qlo - seg0 * w - (r - 1)) // r // bm
        hi = (plan.qhi - seg0 * w) // r // bm
        return seg0, 1, lo, min(nblk - lo, hi - lo + 1)
    return seg0, nseg, 0, nblk


def _trimmed(c, ln, merge: bool, sink: bool) -> Optional[PositionPlan]:
    """Positions launch ``ln`` covers: sliding windows merging into given sums (no launch writes
    every row), no sink key: only the pairs its window reaches (None: none)."""
    p, reach = c.plan, ln.entry[0] - 1
    if not (merge and c.pattern.sliding) or sink or p.mapped:
        return p
    back = 0 if c.causal else reach
    qlo, qhi = max(p.qlo, p.klo - back), min(p.qhi, p.khi + reach)
    klo, khi = max(p.klo, p.qlo - reach), min(p.khi, p.qhi + back)
    return dataclasses.replace(p, qlo=qlo, qhi=qhi, klo=klo, khi=khi) \
        if qlo <= qhi and klo <= khi else None


def _key_tiles(plan: PositionPlan, w: int, r: int, bn: int):
    """(first segment, segments, first block, blocks per segment and class) of the key tiles of
    the dk/dv kernel: one segment of the keys' range (sliding) gets only its blocks."""
    seg0, nseg = _seg_range(plan.klo, plan.khi, w)
    nblk = triton.cdiv(triton.cdiv(w, r), bn)
    if nseg == 1 and w == W_CAP:
        lo = max(0, plan.klo - (r - 1)) // r // bn
        hi = plan.khi // r // bn
        return seg0, 1, lo, min(nblk - lo, hi - lo + 1)
    return seg0, nseg, 0, nblk


def _positions(plan: PositionPlan, device) -> Positions:
    d = _dummy(device)
    qinv = plan.qinv if plan.mapped else d
    kinv = plan.kinv if plan.mapped else d
    qdoc = plan.qdoc if plan.qdoc is not None else d
    kdoc = plan.kdoc if plan.kdoc is not None else d
    sqi = qinv.stride(0) if plan.mapped and qinv.shape[0] > 1 else 0
    ski = kinv.stride(0) if plan.mapped and kinv.shape[0] > 1 else 0
    sqd = qdoc.stride(0) if plan.qdoc is not None and qdoc.shape[0] > 1 else 0
    skd = kdoc.stride(0) if plan.kdoc is not None and kdoc.shape[0] > 1 else 0
    return Positions(qinv, sqi, kinv, ski, qdoc, sqd, kdoc, skd)


def _strided(t: torch.Tensor) -> Strided:
    """A ``[B, H, S, D]`` or ``[B, H, S]`` tensor as the kernels take it (unit last stride)."""
    sb, sh, ss = t.stride()[:3]
    return Strided(t, sb, sh, ss)


def _launch_row(plan, ln, li, nlaunch, h0, nh, group, tiles, sinks, ncfg, psz,
                merge=False) -> dict:
    """The integers of launch ``li`` (of ``nlaunch``) of config launch ``ln``, by name
    (``_common.LAUNCH_FIELDS`` and ``_SCALARS``): heads ``h0 .. h0 + nh`` (``group`` query heads
    per key/value head), ``tiles`` = (first segment, classes, blocks per class, first block).
    ``merge``: every launch merges into the given float32 result (``_participates``), none writes
    the output."""
    seg0, ncls, nblk, blk0 = tiles
    first, last = li == 0 and not merge, li == nlaunch - 1 and not merge
    return dict(HOFF=h0, HCH=nh, GROUP=group, QOFF=plan.qoff, KOFF=plan.koff, QLO=plan.qlo,
                QHI=plan.qhi, KLO=plan.klo, KHI=plan.khi, SEG0=seg0, NCLS=ncls, NBLK=nblk,
                BLK0=blk0, W=ln.w, R=ln.r, LB=ln.lb, SINKS=max(sinks, 1), SKLO=plan.klo,
                SKHI=min(sinks, plan.khi + 1), NCFG=ncfg, NPRI=ln.npri, NLAUNCHED=li + merge,
                FIRST=int(first), LAST=int(last), PSZ=psz)


def _scalars(row: dict) -> tuple:
    """The integer arguments of a launch (``_common._SCALARS``), from its fields."""
    return tuple(row[name] for name in _SCALARS)


def _launch_table(rows, device):
    """One int32 row per launch (``_common.LAUNCH_FIELDS``, given as dicts), made once per
    planned call: the launches take a row each (``_common._launch_scalars``)."""
    pad = [0] * (LAUNCH_ROW - len(LAUNCH_FIELDS))
    table = torch.tensor([[r[f] for f in LAUNCH_FIELDS] + pad for r in rows],
                         dtype=torch.int32, device=device)
    return list(table.unbind(0))


def _needs_pair_mask(earlier, r: int) -> bool:
    """Whether a launch of rate ``r`` after the configs ``earlier`` tests the union rule pair by
    pair on whole tiles: some earlier rate does not divide ``r``, or its classes shift from one
    of its segments to the next. Only then are the key tables faster than the forward's runtime
    loop (docs/decisions.md "Union tables in the forward")."""
    return not all(class_uniform(cfg, r, False) for cfg in earlier)


def _may_mix(earlier, w: int, r: int, tile: int, sliding: bool) -> bool:
    """Whether a program of a launch of ``(w, r)`` (``tile`` class indices per program) may need
    the per-pair union mask on whole tiles (``MIXED``): an earlier rate does not divide ``r``, or
    a program may straddle one of its segments (not if ``r * tile | wj`` and ``wj | w``); sliding
    windows: always. Else the loops compile once, without union code."""
    if sliding:
        return bool(earlier)
    return not all(class_uniform(cfg, r, False) and nests(cfg[0], w, r * tile) for cfg in earlier)


def _union_args(prio, plan, device):
    """(KEYS table, its row length, UTAB): the table path of the union test serves up to four
    earlier configs (41 % faster forward+backward than the loop on longnet_lm, docs/decisions.md);
    longer patterns use the in-kernel loop (UTAB = 0)."""
    n_earlier = len(prio) - 1
    if n_earlier == 0 or n_earlier > 4:
        return _dummy(device), 1, 0
    size = -(-plan.size // (1 << 16)) << 16  # rounded up: one cached table serves many calls
    return union_keys(prio, size, device), size, n_earlier


def _prep(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_target(name, t, shape, dtype):
    if t.shape != shape or t.dtype != dtype or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} with a unit last stride, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")


_CALLS: dict = {}  # FwdPlan / BwdPlan of dilated_fwd / dilated_bwd by _call_key


def _call_key(kind, pattern, plan, q, k, causal, scale, cfg, skip):
    """What a call's launches depend on besides its tensors and strides (planned once per key)."""
    return (kind, pattern, plan.qoff, plan.koff, plan.qlo, plan.qhi, plan.klo, plan.khi,
            plan.base, plan.mapped_kind, plan.qdoc is not None, tuple(q.shape), k.shape[1],
            k.shape[2], q.dtype, q.device, bool(causal), float(scale), cfg, skip)


_CAPTURED: list = []  # what CUDA graphs launched with: kept for good (a replay reads it)


def _planned(key, build, device, keep):
    """``(plan of the call, whether it was made just now)``. Under CUDA-graph capture the plan
    and ``keep`` (the call's position tensors) outlive any cache clear."""
    hit = _CALLS.get(key)
    fresh = hit is None
    if fresh:
        if len(_CALLS) >= 256:
            _CALLS.clear()
        hit = _CALLS[key] = kept(build, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED.append((hit, keep))
    return hit, fresh


class Call(NamedTuple):
    """What a planned call needs besides its tensors (shape: ``(B, Hq, Hkv, Sq, Sk, D)``)."""

    pattern: object
    plan: PositionPlan
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    causal: bool
    cfg: KernelConfig
    skip: tuple = ()  # key/value heads not computed (AttnInputs.skip_kv_heads)
    merge: bool = False  # merge into a given float32 out / dq (dilated_fwd's / _bwd's acc)
    merge_kv: bool = False  # add dk/dv into given float32 sums (dilated_bwd's dkv_acc)


class FwdPlan(NamedTuple):
    """The forward's launches: the config tables, the heads per chunk of the float32 merge
    buffer (0: none) and per launch ``(grid, launch row, integer arguments, keywords)``."""

    tables: tuple
    hch: int
    items: list


class BwdPlan(NamedTuple):
    """The backward's launches: config tables, sink keys, heads per chunk of the float32 sums
    (``(hch, kch)``, None: none), dq and dk/dv launches, and whether the dk/dv launches add into
    the caller's sums (``merge_kv`` without sink keys: their share comes in a first launch)."""

    tables: tuple
    sinks: int
    chunks: object
    dq_items: list
    kv_items: list
    kv_merge: bool = False


def _flags(c: Call, prio, ln, tile, sink, utab) -> Flags:
    """The compile-time flags of launch ``ln`` of call ``c`` (``tile``: class indices per
    program on its own side, for ``_may_mix``)."""
    return Flags(CAUSAL=c.causal, PER_HEAD=c.pattern.query_dilation == "per_head",
                 MAPPED=c.plan.mapped_kind, HAS_DOC=c.plan.qdoc is not None,
                 IEEE=c.dtype == torch.float32, SLIDING=c.pattern.sliding, UTAB=utab,
                 EARLIER=_earlier(ln.npri),
                 MIXED=_may_mix(prio[:ln.npri], ln.w, ln.r, tile, c.pattern.sliding), SINK=sink)


def _head_chunk(heads: int, rows: int, nlaunch: int, cfg: KernelConfig) -> int:
    """Heads per chunk of a float32 sum over ``nlaunch`` launches of ``rows`` float32 rows a
    head: at most ``cfg.acc_bytes``."""
    if nlaunch < 2:
        return heads
    return max(1, min(heads, cfg.acc_bytes // max(rows * 4, 1)))


def _head_runs(heads: int, group: int, skip: tuple, chunk: int):
    """``(first head, heads)`` chunks of at most ``chunk`` of ``heads`` heads, ``group`` per
    key/value head (1: key/value heads), the key/value heads ``skip`` left out."""
    out, h = [], 0
    while h < heads:
        if h // group in skip:
            h += group
            continue
        end = h
        while end < heads and end // group not in skip and end - h < chunk:
            end += 1
        out.append((h, end - h))
        h = end
    return out


def _skipped(skip: tuple, hkv: int, rows: int, cfg: KernelConfig, merge: bool) -> tuple:
    """The key/value heads a call of ``rows`` query rows leaves out (``KernelConfig.skip_rows``);
    merging into given sums, which launches index from their first head, only trailing ones."""
    skip = tuple(j for j in skip if not merge or set(range(j, hkv)) <= set(skip))
    return skip if rows >= cfg.skip_rows or len(_head_runs(hkv, 1, skip, hkv)) <= 1 else ()


def _fill_skipped(skip: tuple, group: int, *fills) -> None:
    """``t[:, heads of skipped key/value head j] = value`` for each ``(t, value)`` in ``fills``."""
    for j in skip:
        for t, value in fills:
            t.narrow(1, j * group, group).fill_(value)


def plan_fwd(c: Call) -> FwdPlan:
    """The forward's launches of call ``c``: a pure function of it."""
    B, HQ, HKV, SQ, _, D = c.shape
    prio, launch, sinks = _launches(c.pattern, c.plan, c.causal)
    # merge: the caller's float32 result holds every head (one chunk; skipped heads stay as given)
    hch = HQ if c.merge else _head_chunk(HQ, B * SQ * D, len(launch), c.cfg)
    # the union test: the key tables (as in the backward) for launches that need the per-pair
    # mask, else the runtime loop
    keys, psz, utab = (_union_args(prio, c.plan, c.device) if any(ln.pair for ln in launch)
                       else (_dummy(c.device), 1, 0))
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
            BM, BN, warps, stages = tiles[tab > 0, not _earlier(ln.npri)]
            seg0, nseg, blk0, nblk = _query_tiles(lp, ln.w, ln.r, BM)
            ncls = 1 if c.pattern.query_dilation == "per_head" else ln.r
            rows.append(_launch_row(lp, ln, li, len(launch), h0, nh, HQ // HKV,
                                    (seg0, ncls, nblk, blk0), sinks, len(prio), psz, c.merge))
            kw = dict(BM=BM, BN=BN, D=D, F=_flags(c, prio, ln, BM, bool(sinks) and last, tab),
                      num_warps=warps, num_stages=stages)
            cap = fwd_max_registers((BM, BN, warps), not _earlier(ln.npri))
            if cap and c.dtype != torch.float32 and not c.cfg.interpret:
                kw["maxnreg"] = cap
            items.append(((nseg * ncls * nblk, B * nh), _scalars(rows[-1]), kw))
    tables = (_cfg_tensor(prio, c.device), _cfg_tensor([ln.entry for ln in launch], c.device),
              keys)
    items = [(grid, row, ints, kw)
             for (grid, ints, kw), row in zip(items, _launch_table(rows, c.device))]
    return FwdPlan(tables, hch if len(launch) > 1 and not c.merge else 0, items)


def dilated_fwd(q, k, v, pattern, scale: float, causal: bool, plan: PositionPlan, out=None,
                lse=None, skip: tuple = (), acc=None):
    """Forward launches. q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,Sk,D]`` → (out, lse float32 natural log),
    planned once per call key (:func:`plan_fwd`). ``out`` / ``lse``: tensors to write into (unit
    last stride). ``skip``: key/value heads not computed (out 0, lse -inf). ``acc``: a float32
    result with its given ``lse`` over other keys (0, -inf at first) this call merges into (the
    ring's pieces; ``out`` not written)."""
    q, k, v = _prep(q), _prep(k), _prep(v)
    B, HQ, SQ, D = q.shape
    dev = q.device
    merge = acc is not None
    if merge:  # out: not written (q stands in: the kernels' output type stays q's)
        _check_target("acc", acc, q.shape, torch.float32)
        out = q
    elif out is None:
        out = torch.empty_like(q)
    _check_target("out", out, q.shape, q.dtype)
    if lse is None:
        lse = torch.empty((B, HQ, SQ), device=dev, dtype=torch.float32)
    _check_target("lse", lse, q.shape[:3], torch.float32)
    if SQ == 0:
        return (acc if merge else out), lse
    cfg = kernel_config()
    skip = _skipped(skip, k.shape[1], B * SQ, cfg, merge)
    if not merge:
        _fill_skipped(skip, HQ // k.shape[1], (out, 0.0), (lse, float("-inf")))
    pattern = for_ranges(pattern, plan.qlo, plan.qhi, plan.klo, plan.khi, causal)
    pos = _positions(plan, dev)
    fp, fresh = _planned(
        _call_key("fwd", pattern, plan, q, k, causal, scale, cfg, (skip, merge)),
        lambda: plan_fwd(Call(pattern, plan, (B, HQ, k.shape[1], SQ, k.shape[2], D), q.dtype,
                              dev, bool(causal), cfg, skip, merge)), dev, pos)
    if not merge:
        acc = torch.empty((B, fp.hch, SQ, D), device=dev, dtype=torch.float32) if fp.hch \
            else out
    head = (_strided(q), _strided(k), _strided(v), _strided(out), _strided(lse), _strided(acc),
            pos, fp.tables)
    scale_log2 = scale * LOG2E
    _run([(_fwd_kernel, grid, head, (row, *ints, scale_log2), kw)
          for grid, row, ints, kw in fp.items], fresh, cfg)
    return (acc if merge else out), lse


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
    ncls_q = 1 if c.pattern.query_dilation == "per_head" else None
    smem = _smem(c.device, c.cfg)
    dq_tiles = {p: _blocks("dq", D, c.dtype, smem, p, cfg=c.cfg) for p in (False, True)}
    kv_tiles = {f: _blocks("dkdv", D, c.dtype, smem, skips=f, cfg=c.cfg) for f in (False, True)}
    kBM, kBN = kv_tiles[False][:2]  # (both the same: the key tiles and _may_mix use kBN)
    # union test: the key tables hold the configs but the last (up to four earlier ones);
    # the sink launch (after all of them in priority), sliding windows and longer patterns
    # test the configs in a runtime loop (decisions.md, "One union test in a loop")
    keys, psz, utab = (_union_args(prio, c.plan, c.device) if not c.pattern.sliding
                       else (_dummy(c.device), 1, 0))

    def row(lp, li, ln, h0, nh, tiles, merge=False):
        return _launch_row(lp, ln, li, len(launch), h0, nh, HQ // HKV, tiles, sinks,
                           len(prio), psz, merge)

    # dq: one program per query tile, as in the forward, a chunk of heads at a time (first:
    # the sink launch's dk/dv sums are needed by the dk/dv kernel)
    dq_items, rows = [], []
    for h0, nh in _head_runs(HQ, HQ // HKV, c.skip, hch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, c.merge, bool(sinks) and li == len(launch) - 1)
            if lp is None:
                continue
            BM, BN, warps, stages = dq_tiles[ln.pair]
            seg0, nseg, blk0, nblk = _query_tiles(lp, ln.w, ln.r, BM)
            ncls = ncls_q or ln.r
            rows.append(row(lp, li, ln, h0, nh, (seg0, ncls, nblk, blk0), c.merge))
            fl = _flags(c, prio, ln, BM, bool(sinks) and li == len(launch) - 1, utab)
            kw = dict(BM=BM, BN=BN, D=D, F=fl, num_warps=warps, num_stages=stages)
            dq_items.append(((nseg * ncls * nblk, B * nh), _scalars(rows[-1]), kw))
    # dk, dv: one program per key tile of one key/value head, a chunk of heads at a time
    kv_items = []
    for g0, ng in _head_runs(HKV, 1, c.skip, kch):
        for li, ln in enumerate(launch):
            lp = _trimmed(c, ln, kv_merge, False)  # kv_merge: no sink key
            if lp is None:
                continue
            kseg0, knseg, kblk0, knblk = _key_tiles(lp, ln.w, ln.r, kBN)
            rows.append(row(lp, li, ln, g0, ng, (kseg0, ln.r, knblk, kblk0), kv_merge))
            fl = _flags(c, prio, ln, kBN, bool(sinks), utab)
            warps, stages = kv_tiles[fl.EARLIER and not fl.MIXED][2:]
            kw = dict(BM=kBM, BN=kBN, D=D, F=fl, num_warps=warps, num_stages=stages)
            kv_items.append(((knseg * ln.r * knblk, B * ng), _scalars(rows[-1]), kw))
    tables = (_cfg_tensor(prio, c.device), _cfg_tensor([ln.entry for ln in launch], c.device),
              keys)
    table = _launch_table(rows, c.device)  # the dq launches' rows, then the dk/dv launches'
    dq_items = [(g, r, ints, kw) for (g, ints, kw), r in zip(dq_items, table)]
    kv_items = [(g, r, ints, kw) for (g, ints, kw), r in zip(kv_items, table[len(dq_items):])]
    chunks = (0 if c.merge else hch, 0 if kv_merge else kch) if len(launch) > 1 else None
    return BwdPlan(tables, sinks, chunks, dq_items, kv_items, kv_merge)


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
                dkv_acc=None):
    """Backward launches → (dq, dk, dv) in the input dtype (``dlse`` may be None), planned once per
    call key (:func:`plan_bwd`). ``dq``/``dk``/``dv``: tensors (or views) to write into; float32
    sums over configs hold a chunk of heads at a time (``_sum_buffers``). ``skip``: key/value
    heads not computed (zero gradients). ``dq_acc`` / ``dkv_acc``: float32 sums this call's dq /
    (dk, dv) add into (the ring's pieces; dk/dv in the kernels where no key is a sink)."""
    q, k, v, out, do = _prep(q), _prep(k), _prep(v), _prep(out), _prep(do)
    B, HQ, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    dev = q.device
    merge = dq_acc is not None
    if merge:  # dq: not written (q stands in: the kernels' output type stays q's)
        _check_target("dq_acc", dq_acc, q.shape, torch.float32)
        dq = q
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_target(name, g, t.shape, t.dtype)
    if SQ == 0 or SK == 0:
        return (dq_acc if merge else dq.zero_()), *(dkv_acc or (dk.zero_(), dv.zero_()))
    cfg = kernel_config()
    skip = _skipped(skip, HKV, B * SQ, cfg, merge or dkv_acc is not None)
    _fill_skipped(() if merge else skip, HQ // HKV, (dq, 0.0))
    for name, t in zip(("dk_acc", "dv_acc"), dkv_acc or ()):
        _check_target(name, t, k.shape, torch.float32)
    pattern = for_ranges(pattern, plan.qlo, plan.qhi, plan.klo, plan.khi, causal)
    lse, delta = _bwd_stats(lse, B, HQ, SQ, dev)
    dblk = 64 if not cfg.interpret else 16
    run = [(_delta_kernel, (triton.cdiv(SQ, dblk), B * HQ),
            (_strided(out), _strided(do), dlse.contiguous() if dlse is not None else delta,
             _strided(delta), SQ, HQ), (), dict(BM=dblk, D=D, HAS_DLSE=dlse is not None))]
    pos = _positions(plan, dev)
    bp, fresh = _planned(
        _call_key("bwd", pattern, plan, q, k, causal, scale, cfg,
                  (skip, merge, dkv_acc is not None)),
        lambda: plan_bwd(Call(pattern, plan, (B, HQ, HKV, SQ, SK, D), q.dtype, dev,
                              bool(causal), cfg, skip, merge, dkv_acc is not None)), dev, pos)
    if not bp.kv_merge:
        _fill_skipped(skip, 1, (dk, 0.0), (dv, 0.0))
    if bp.chunks is None:  # one launch per kernel writes the result in the input dtype
        dqacc, dkacc, dvacc = dq, dk, dv
    else:
        dqacc, dkacc, dvacc = _sum_buffers(B, *bp.chunks, SQ, SK, D, dev)
    dqacc = dq_acc if merge else dqacc
    if bp.kv_merge:  # dk, dv: not written (k, v stand in, as q for dq)
        (dkacc, dvacc), dk, dv = dkv_acc, k, v
    # The last dq launch also sums the sink keys' dk/dv (float32, atomically, over its query
    # tiles); the first dk/dv launch adds them in.
    if bp.sinks:
        sinkg = _strided(torch.zeros((B, HKV, 2 * bp.sinks, D), device=dev,
                                     dtype=torch.float32))
    else:
        sinkg = Strided(_dummy(dev), 0, 0, 0)
    qs, ks, vs, dos = _strided(q), _strided(k), _strided(v), _strided(do)
    lses, deltas = _strided(lse), _strided(delta)
    scales = (scale, scale * LOG2E)
    head = (qs, ks, vs, dos, lses, deltas, _strided(dq), _strided(dqacc), sinkg, pos, bp.tables)
    run += [(_dq_kernel, grid, head, (row, *ints, scales), kw)
            for grid, row, ints, kw in bp.dq_items]
    head = (qs, ks, vs, dos, lses, deltas, _strided(dk), _strided(dv), _strided(dkacc),
            _strided(dvacc), sinkg, pos, bp.tables)
    run += [(_dkdv_kernel, grid, head, (row, *ints, scales), kw)
            for grid, row, ints, kw in bp.kv_items]
    _run(run, fresh, cfg)
    if dkv_acc is None:
        return (dq_acc if merge else dq), dk, dv
    if not bp.kv_merge:  # sink keys here: the sums on the host
        dkv_acc[0].add_(dk), dkv_acc[1].add_(dv)
    return (dq_acc if merge else dq), *dkv_acc
