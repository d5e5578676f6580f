"""A call's launches, planned on the host: what the forward's and the backward's planners
(``plan_fwd`` / ``plan_bwd``) and runners share — the config launches of a call, their tiles,
heads and integer rows, the per-call plan memo, the small device tables, the runners' setup.

Host code only (no Triton kernel here); the launchers are ``_fwd.dilated_fwd`` /
``_bwd.dilated_bwd``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch
import triton

from ..dense_heads import DENSE
from ..plan_cache import kept, memoised
from ..planning import class_uniform, config_meets, covered_window, for_ranges, nests, sink_keys
from ._common import _SCALARS, LAUNCH_FIELDS, LAUNCH_ROW, Flags, Positions, Strided
from . import _config
from ._config import KernelConfig, kernel_config
from ._plan import (W_CAP, PositionPlan, bwd_blocks, config_order, dkdv_blocks, fwd_blocks,
                    union_keys)

def _smem(device, cfg: KernelConfig) -> Optional[int]:
    """Shared memory per program (opt-in maximum, bytes) of ``device``; None off CUDA."""
    return cfg.smem if cfg.smem is not None or device.type != "cuda" else _optin_smem(
        device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _optin_smem(index: int) -> Optional[int]:
    return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)


def _blocks(kind, d, dtype, smem=None, pair=False, first=False, skips=False, cfg=None):
    """The tile of ``kind`` (the configuration's override first) for a launch that tests the
    union rule pair by pair (``pair``: forward through the key tables, see
    ``_needs_pair_mask``), has no earlier config (``first``, forward) or has earlier ones but
    no program that needs the per-pair mask (``skips``, dk/dv; ``_may_mix``)."""
    cfg = kernel_config() if cfg is None else cfg
    tile = fwd_blocks(d, dtype, cfg.interpret, pair, first) if kind == "fwd" else \
        bwd_blocks(d, dtype, cfg.interpret, smem, pair) if kind == "dq" else \
        dkdv_blocks(d, dtype, cfg.interpret, smem, skips)
    over = tuple(cfg.tile_override(kind, first) or ())  # (BM, BN) or (BM, BN, warps, stages)
    return over + tuple(tile)[len(over):]


_SMALL: dict = {}  # small int32 device tensors by (content, device): made once, never per call


def _small_tensor(values: tuple, device) -> torch.Tensor:
    """A cached int32 tensor on ``device`` (made per call: a host-to-device copy, uncapturable)."""
    return memoised(_SMALL, (values, str(device)), 257, lambda: kept(
        lambda: torch.tensor(values, device=device, dtype=torch.int32), device))


def _dummy(device):
    return _small_tensor((0,), device)


class _Launch(NamedTuple):
    """One launch: tiling segment (sliding: ``W_CAP``), rate, band reach in class steps, the
    configs before it that its union test runs over (none: compiled without the union code, no
    spills on sm_90, 18 % faster; docs/decisions.md), its ``(w, r)`` for ``_participates``,
    per-pair union test (``_needs_pair_mask``) and the band's near edge ``lc`` (``_band_edge``)."""

    w: int
    r: int
    lb: int
    npri: int
    entry: tuple
    pair: bool
    lc: int = 0


def _band_edge(earlier, r: int, causal: bool) -> Optional[int]:
    """Sliding windows, causal, every earlier rate dividing ``r``: each earlier config ``(w_i,
    r_i)`` allows exactly the keys of this launch's class less than ``w_i`` positions back, so
    the launch owns the keys at least ``lc = max ceil(w_i / r)`` class steps back — a band edge
    like the diagonal, no union test (docs/kernels.md). None where that does not hold."""
    nested = causal and all(class_uniform(cfg, r, True) for cfg in earlier)
    return -(-covered_window(earlier, r) // r) if nested else None


def _launches(pattern, plan: PositionPlan, causal: bool = True):
    """``(priority configs, launches in order, sinks)``: the config covering every query last
    (it writes the result and takes the sink keys: ``sinks`` > 0 when a key of this call is one),
    others only where they join a query and a key of this call (``planning.config_meets``)."""
    prio, order = config_order(pattern)
    out, q_rng, k_rng = [], (plan.qlo, plan.qhi), (plan.klo, plan.khi)
    for i, (w, r) in enumerate(order):
        if i < len(order) - 1 and not config_meets(w, pattern.sliding, causal, q_rng, k_rng):
            continue
        npri = prio.index((w, r))
        if pattern.sliding:
            lc = _band_edge(prio[:npri], r, causal)
            out.append(_Launch(W_CAP, r, (w - 1) // r, npri if lc is None else 0, (w, r), False,
                               lc or 0))
        else:
            out.append(_Launch(w, r, 0, npri, (w, r), _needs_pair_mask(prio[:npri], r)))
    return prio, out, sink_keys(pattern, plan.klo, plan.base)


def _tiles(lo: int, hi: int, w: int, r: int, blk: int, narrow: bool):
    """(first segment, segments, first block, blocks per segment and class) of the tiles of
    ``blk`` class indices over positions ``[lo, hi]``: inside one segment (``narrow``) only the
    blocks that can hold them (the query tiles: a short query range, decoding; the dk/dv
    kernel's key tiles of sliding windows: one segment of the keys' range)."""
    seg0, nseg = lo // w, hi // w - lo // w + 1
    nblk = triton.cdiv(triton.cdiv(w, r), blk)
    if nseg == 1 and narrow:
        first = max(0, lo - seg0 * w - (r - 1)) // r // blk
        return seg0, 1, first, min(nblk - first, (hi - seg0 * w) // r // blk - first + 1)
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


def _positions(plan: PositionPlan, device) -> tuple:
    """``(pos, lead, tail)``: the position and document tables of a call as the kernels take
    them (each with its row stride, 0 for one row shared by the batch; an unused one: a dummy),
    and a launch's ``(lead, tail)``: ``pos`` in its head, guarded and read at every call
    (``((pos,), ())``: another call of the same key may have other tables), or, at natural
    positions without documents (dummies the kernels never read), after it (``((), (pos,))``),
    read once when the launch is bound (``_launch.launch_all``)."""
    d, out = _dummy(device), []
    for t in (plan.qinv, plan.kinv, plan.qdoc, plan.kdoc):  # (tables: mapped plans only)
        out += [d, 0] if t is None else [t, t.stride(0) if t.shape[0] > 1 else 0]
    pos, fixed = Positions(*out), not plan.mapped and plan.qdoc is None and plan.kdoc is None
    return (pos, (), (pos,)) if fixed else (pos, (pos,), ())


def _strided(t: torch.Tensor) -> Strided:
    """A ``[B, H, S, D]`` or ``[B, H, S]`` tensor as the kernels take it (unit last stride)."""
    return Strided(t, *t.stride()[:3])


def _launch_row(c, plan, ln, li, nlaunch, h0, nh, tiles, sinks, ncfg, psz, merge) -> dict:
    """The integers of launch ``li`` (of ``nlaunch``) of config launch ``ln`` of call ``c`` at
    positions ``plan``, by name (``_common.LAUNCH_FIELDS`` and ``_SCALARS``): heads ``h0 .. h0 +
    nh``, ``tiles`` = (first segment, classes, blocks per class, first block). ``merge``: every
    launch merges into the given float32 result (``_participates``), none writes the output.
    Head 0 is head ``Call.hbase`` of the pattern's rule."""
    seg0, ncls, nblk, blk0 = tiles
    return dict(HOFF=h0, HCH=nh, GROUP=c.shape[1] // c.shape[2], QOFF=plan.qoff, KOFF=plan.koff,
                QLO=plan.qlo, QHI=plan.qhi, KLO=plan.klo, KHI=plan.khi, SEG0=seg0, NCLS=ncls,
                NBLK=nblk, BLK0=blk0, W=ln.w, R=ln.r, LB=ln.lb, SINKS=max(sinks, 1),
                SKLO=plan.klo, SKHI=min(sinks, plan.khi + 1), NCFG=ncfg, NPRI=ln.npri, LC=ln.lc,
                NLAUNCHED=li + merge, FIRST=int(li == 0 and not merge),
                LAST=int(li == nlaunch - 1 and not merge), PSZ=psz, HBASE=c.hbase)


def _launch_table(prio, launch, keys, items, rows, device):
    """``(tables, items)`` of a planned call: its config tables (priority configs, those of the
    launches ``launch``, the union ``keys``) and its launches ``items`` ``(grid, keywords)`` as
    ``(grid, launch row, integer arguments, keywords)``: each launch's fields ``rows`` (dicts) as
    one int32 row (``_common.LAUNCH_FIELDS``) of a table made once per planned call (the launch
    reads it: ``_common._launch_scalars``) and as integer arguments (``_common._SCALARS``)."""
    table = torch.tensor([[r[f] for f in LAUNCH_FIELDS] + [0] * (LAUNCH_ROW - len(LAUNCH_FIELDS))
                          for r in rows], dtype=torch.int32, device=device)
    tables = tuple(_small_tensor(tuple(x for wr in cfgs for x in wr) or (1, 1), device)
                   for cfgs in (prio, [ln.entry for ln in launch])) + (keys,)
    return tables, [(g, t, tuple(r[name] for name in _SCALARS), kw)
                    for (g, kw), r, t in zip(items, rows, table.unbind(0))]


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
    return bool(earlier) if sliding else not all(
        class_uniform(cfg, r, False) and nests(cfg[0], w, r * tile) for cfg in earlier)


def _union_args(prio, plan, device, tables: bool):
    """(KEYS table, its row length, UTAB): the table path of the union test (where ``tables``)
    serves up to four earlier configs (41 % faster forward+backward than the loop on longnet_lm,
    docs/decisions.md); longer patterns and the others use the in-kernel loop (UTAB = 0)."""
    n_earlier = len(prio) - 1
    if not tables or n_earlier == 0 or n_earlier > 4:
        return _dummy(device), 1, 0
    size = -(-plan.size // (1 << 16)) << 16  # rounded up: one cached table serves many calls
    return union_keys(prio, size, device), size, n_earlier


def _prep(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_target(name, t, shape, dtype):
    if t is not None and (t.shape != shape or t.dtype != dtype or t.stride(-1) != 1):
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} with a unit last stride, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")


_CALLS: dict = {}  # FwdPlan / BwdPlan of dilated_fwd / dilated_bwd by call key (_call_plans)


_CAPTURED: list = []  # what CUDA graphs launched with: kept for good (a replay reads it)


def kept_if_captured(device, keep) -> None:
    """Keep ``keep`` (a call's plans and tables) for good while a CUDA graph captures."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _CAPTURED.append(keep)


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
    hbase: int = 0  # query head h is head hbase + h of the pattern's rule (a head shard's)
    softcap: float = 0.0  # scores soft-capped at this value (0: not)


class FwdPlan(NamedTuple):
    """The forward's launches: the config tables, the heads per chunk of the float32 merge
    buffer (0: none) and per launch ``(grid, launch row, integer arguments, keywords)``."""

    tables: tuple
    hch: int
    items: list


class BwdPlan(NamedTuple):
    """The backward's launches: config tables, sink keys, heads per chunk of the float32 sums
    (``(hch, kch)``, None: none), dq and dk/dv launches, whether the dk/dv launches add into
    the caller's sums (``merge_kv`` without sink keys: their share comes in a first launch),
    whether the sink keys' sums start from zeros (else the first dq launch zeroes them: one
    before the launch that takes the sink keys)."""

    tables: tuple
    sinks: int
    chunks: object
    dq_items: list
    kv_items: list
    kv_merge: bool = False
    zero_sinks: bool = False
    kv_alt: tuple = ()  # per dk/dv launch: None, or the Triton kernel's keywords of a launch
    # planned on the Gluon kernel (``_dkdv_wgmma``), for inputs that kernel cannot load


def _flags(c: Call, prio, ln, tile, sink, utab) -> Flags:
    """The compile-time flags of launch ``ln`` of call ``c`` (``tile``: class indices per
    program on its own side, for ``_may_mix``)."""
    return Flags(CAUSAL=c.causal, PER_HEAD=c.pattern.query_dilation == "per_head",
                 MAPPED=c.plan.mapped_kind, HAS_DOC=c.plan.qdoc is not None,
                 IEEE=c.dtype == torch.float32, SLIDING=c.pattern.sliding, UTAB=utab,
                 EARLIER=ln.npri > 0,
                 MIXED=_may_mix(prio[:ln.npri], ln.w, ln.r, tile, c.pattern.sliding), SINK=sink,
                 SOFTCAP=c.softcap > 0, HAS_DLSE=False)


def _head_chunk(heads: int, rows: int, nlaunch: int, cfg: KernelConfig) -> int:
    """Heads per chunk of a float32 sum over ``nlaunch`` launches of ``rows`` float32 rows a
    head: at most ``cfg.acc_bytes``."""
    return heads if nlaunch < 2 else max(1, min(heads, cfg.acc_bytes // max(rows * 4, 1)))


def _head_runs(heads: int, group: int, skip: tuple, chunk: int):
    """``(first head, heads)`` chunks of at most ``chunk`` of ``heads`` heads, ``group`` per
    key/value head (1: key/value heads), the key/value heads ``skip`` left out."""
    out = []
    for h in range(heads):
        if h // group in skip:
            continue
        if out and sum(out[-1]) == h and out[-1][1] < chunk:  # the run before goes on
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((h, 1))
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


def _head_split(pattern, skip: tuple, shape: tuple, cfg: KernelConfig, merge: bool):
    """``(sparse pattern, key/value heads its launches leave out, heads to fill with 0, key/value
    heads the dense heads' launches leave out)`` of a call that leaves out ``skip``: its dense
    key/value heads (``pattern.dense_kv_heads``) are left to their own launch where that adds no
    launch (``_skipped``), else computed and then overwritten by it; the dense heads' launches
    leave out every other key/value head, and those the call leaves out (``skip``)."""
    dense, hkv, rows = pattern.dense_kv_heads, shape[2], shape[0] * shape[3]
    if dense and merge:
        raise ValueError("dense key/value heads cannot merge into given sums (the ring runs "
                         "them as a ring of their own)")
    left = _skipped(tuple(sorted(set(skip) | set(dense))), hkv, rows, cfg, merge)
    return (pattern.sparse_part, left, tuple(j for j in left if j not in dense),
            tuple(j for j in range(hkv) if j not in dense or j in skip))


def _call_plans(build, q, k, pattern, plan: PositionPlan, causal, scale, skip: tuple,
                flags: tuple, hbase: int, softcap: float):
    """``(configuration, sparse plan, dense plan or None, whether they were made just now, heads
    to fill, positions, the memo of their launches: ``_launch.launch_all``'s, and the positions'
    ``(lead, tail)``: ``_positions``)`` of a call under :func:`kernel_config`, made once per
    call key: ``build`` (``_fwd.plan_fwd`` / ``_bwd.plan_bwd``) of the sparse pattern leaving
    out ``skip`` (and, where that adds no launch, the dense key/value heads: ``_head_split``)
    and of the plain causal config over the dense heads, whose launches come last (they
    overwrite what the sparse ones computed for them). ``flags``: ``Call``'s ``merge`` (and
    ``merge_kv``); ``hbase``, ``softcap``: its own."""
    (B, HQ, SQ, D), dev, cfg = q.shape, q.device, kernel_config()
    shape = (B, HQ, k.shape[1], SQ, k.shape[2], D)

    def make():
        sparse, left, fill, dense_skip = _head_split(pattern, skip, shape, cfg, any(flags))
        same = (plan, shape, q.dtype, dev, bool(causal), cfg)
        ranged = for_ranges(sparse, plan.qlo, plan.qhi, plan.klo, plan.khi, causal)
        dense = pattern.dense_kv_heads and build(Call(DENSE, *same, dense_skip, softcap=softcap))
        return (build(Call(ranged, *same, left, *flags, hbase=hbase, softcap=softcap)),
                dense or None, fill, {})

    pos, lead, tail = _positions(plan, dev)
    # the call key: what its launches depend on besides its tensors and strides
    key = (build.__name__, pattern, plan.qoff, plan.koff, plan.qlo, plan.qhi, plan.klo,
           plan.khi, plan.base, plan.mapped_kind, plan.qdoc is not None, tuple(q.shape),
           k.shape[1], k.shape[2], q.dtype, q.device, bool(causal), float(scale), cfg,
           (skip, *flags, hbase, softcap))
    fresh = key not in _CALLS
    sparse, dense, fill, memo = hit = memoised(_CALLS, key, 256, lambda: kept(make, dev))
    kept_if_captured(dev, (hit, pos))  # (under CUDA-graph capture: past any cache clear)
    return cfg, sparse, dense, fresh, fill, pos, memo, lead, tail


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
