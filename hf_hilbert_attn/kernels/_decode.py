"""Decode kernel: a few queries against a long key/value cache, split over keys
(flash-decoding), the pattern's rule evaluated per key tile from the keys' positions.

The queries of the ``G = Hq // Hkv`` query heads that read one key/value head are the rows of
one tile (``G * Sq`` rows, zero-padded to ``BR >= 16`` for ``tl.dot``), so each key is read
once per key/value head. Per key tile the kernel loads the keys' positions and evaluates the
pattern (:class:`Rule`: configs, sink tokens, dense key/value heads, causality, documents and
padding, as ``DilatedPattern.allowed``); a tile no row may attend is skipped without loading
its keys. Program ``(b * Hkv + j, split)`` sums its share of the keys in float32; alone, it
writes the result, else its partial result, and the split that finishes last (a counter per
``b * Hkv + j``, which that split resets) merges the partials by log-sum-exp: one launch.
"""

import functools
from collections import namedtuple

import torch
import triton
import triton.language as tl

from ._common import LN2, Strided, _dot, _logits2, _scales
from ._launch import launch_all, relaunch

__all__ = ["DecodeLauncher", "Rule"]

_MIN_TILES, _MAX_SPLITS = 8, 16  # key tiles per split at least, splits at most (the merge
# reads the partial results one after another: docs/decisions.md D54); a dense head, which
# reads every key where the others skip the slots no window reaches, takes up to
# _DENSE_SPLITS times their splits of as many tiles each (D79)
_DENSE_SPLITS = 4

# The pattern of a step: int32 positions ``QP [B, Sq]`` / ``KP [B, Sk]`` and document ids ``QD``
# / ``KD`` (the same shapes; a negative key id is padding; the positions again without
# documents), int32 ``CFG [NC, 2]`` (window, rate; ``NC`` a power of two, the first config
# repeated to fill it), int8 ``DENSE [Hkv]`` (1: a dense key/value head), ``SINKS`` sink tokens.
# Without tables (``POSITIONS`` False: a cache's own layout, the four position tensors unread),
# query ``i`` sits at ``QBASE + i`` and key slot ``n`` at ``n``, or ``n + KDROP`` from ``SINKS`` on.
Rule = namedtuple("Rule", "QP KP QD KD CFG DENSE SINKS")
# The compile-time flags (one ``tl.constexpr``): float32 inputs multiplied in full precision,
# sliding windows, per_head classes, documents, position rows (``POSITIONS``; else ``QBASE`` /
# ``KDROP``), the lse written, soft-capped scores.
DecodeFlags = namedtuple("DecodeFlags",
                         "IEEE SLIDING PER_HEAD HAS_DOC POSITIONS WITH_LSE SOFTCAP")


@triton.jit
def _query_side(p, h, rule, NC: tl.constexpr, SLIDING: tl.constexpr, PER_HEAD: tl.constexpr):
    """What the rule needs of the queries, per config ``[NC, BR, 1]`` (made once, before the key
    loop): window ``w``, rate ``r``, the queries' class and segment (sliding: position), and
    whether a query's class is its head's (per_head; else every class)."""
    c = tl.arange(0, NC)
    w = tl.load(rule.CFG + 2 * c)[:, None, None]
    r = tl.load(rule.CFG + 2 * c + 1)[:, None, None]
    p3 = p[None, :, :]
    if SLIDING:  # one group per class p % r, within the window
        cq, seg = p3 % r, p3
    else:  # segment p // w, class (p % w) % r
        cq, seg = (p3 % w) % r, p3 // w
    mine = (cq == h[None, :, :] % r) | (not PER_HEAD)
    return w, r, cq, seg, mine


@triton.jit
def _allowed(s, w, r, cq, seg, mine, SINKS, SLIDING: tl.constexpr):
    """``[BR, BN]``: the union of the configs (``_query_side``'s) and the sink rule for key
    positions ``s`` ``[1, BN]`` (non-negative), causality apart."""
    s3 = s[None, :, :]
    if SLIDING:
        hit = (s3 % r == cq) & (seg - s3 < w)
    else:
        hit = ((s3 % w) % r == cq) & (s3 // w == seg)
    return (tl.max((hit & mine).to(tl.int32), 0) > 0) | (s < SINKS)


@triton.jit
def _store_rows(o_t, LSE, o, lse, b, h, i, rok, HQ, SQ, D: tl.constexpr,
                WITH_LSE: tl.constexpr):
    """Rows ``(h, i)`` of batch ``b``: ``o`` into ``o_t`` (its dtype), ``lse`` (natural log)
    into ``LSE`` ``[B, Hq, Sq]``."""
    d = tl.arange(0, D)
    tl.store(o_t.ptr + b * o_t.sb + h.to(tl.int64)[:, None] * o_t.sh + i[:, None] * o_t.ss
             + d[None, :], o.to(o_t.ptr.dtype.element_ty), mask=rok[:, None])
    if WITH_LSE:
        tl.store(LSE + (b * HQ + h) * SQ + i, lse, mask=rok)


@triton.jit(do_not_specialize=["SK", "NSPLIT", "NSPLIT_D", "QBASE", "KDROP"])
def _decode_kernel(q_t, k_t, v_t, o_t, LSE, rule, WS, CNT, HKV, GROUP, SQ, ROWS, SK, NSPLIT,
                   NSPLIT_D, QBASE, KDROP, scales, BR: tl.constexpr, BN: tl.constexpr,
                   D: tl.constexpr, NC: tl.constexpr, F: tl.constexpr):
    # q_t, k_t, v_t, o_t: ``Strided`` [B, H, S, D]; WS: float32 [B*Hkv*splits*BR, D + 1];
    # scales: ``_common._logits2``'s. The NSPLIT splits of a sparse head share its key slots,
    # the NSPLIT_D of a dense head every slot (programs past a head's splits do nothing).
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    j = bh % HKV
    r = tl.arange(0, BR)
    rok = r < ROWS
    h = j * GROUP + r // SQ  # row r: query head j*G + r // Sq, query r % Sq
    i = r % SQ
    d = tl.arange(0, D)
    q = tl.load(q_t.ptr + b * q_t.sb + h[:, None].to(tl.int64) * q_t.sh + i[:, None] * q_t.ss
                + d[None, :], mask=rok[:, None], other=0.0)
    if F.POSITIONS:
        p = tl.load(rule.QP + b * SQ + i, mask=rok, other=0)[:, None]
    else:
        p = (QBASE + i)[:, None]
    if F.HAS_DOC:
        qd = tl.load(rule.QD + b * SQ + i, mask=rok, other=-2)[:, None]
    dense = tl.load(rule.DENSE + j) != 0  # every key (causal, documents) for this head
    cw, cr, cq, seg, mine = _query_side(p, h[:, None], rule, NC, F.SLIDING, F.PER_HEAD)
    kb = k_t.ptr + b * k_t.sb + j.to(tl.int64) * k_t.sh
    vb = v_t.ptr + b * v_t.sb + j.to(tl.int64) * v_t.sh
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    ks, kl = 0, 0
    if not F.POSITIONS:  # a sparse head in a cache's layout skips the slots [ks, kl) between
        # the sinks' tiles and the first position a window of one of its rows reaches
        first = tl.where(mine & rok[None, :, None], seg - cw + 1 if F.SLIDING else seg * cw,
                         p[None, :, :])
        ks = tl.cdiv(rule.SINKS, BN) * BN
        first = tl.min(tl.min(tl.min(first, 2), 1), 0) - KDROP  # (its slot)
        kl = tl.maximum(tl.maximum(first, rule.SINKS) // BN * BN, ks)
    jump = tl.where(dense, 0, kl - ks)  # tile t of the keys kept: slots t*BN on, past ks + jump
    nsplit = tl.where(dense, NSPLIT_D, NSPLIT)
    per = tl.cdiv(tl.cdiv(SK - jump, BN), nsplit) * BN
    lo = sp * per
    hi = tl.minimum(lo + per, SK - jump)
    for t0 in range(lo, hi, BN):
        n = t0 + tl.where(t0 >= ks, jump, 0) + tl.arange(0, BN)
        nok = n < SK
        if F.POSITIONS:
            s = tl.load(rule.KP + b * SK + n, mask=nok, other=0)[None, :]
        else:
            s = (n + tl.where(n >= rule.SINKS, KDROP, 0))[None, :]
        ok = (s <= p) & nok[None, :] & rok[:, None]
        if F.HAS_DOC:
            kd = tl.load(rule.KD + b * SK + n, mask=nok, other=-1)[None, :]
            ok = ok & (kd == qd) & (kd >= 0)
        if dense == 0:  # (a dense key/value head attends every key: no rule to evaluate)
            ok = ok & _allowed(s, cw, cr, cq, seg, mine, rule.SINKS, F.SLIDING)
        if F.POSITIONS:  # (padding, documents: a tile no row attends is not loaded)
            go = tl.max(tl.max(ok.to(tl.int32), 1), 0) > 0
        else:  # (a row attends some key of every tile kept: no branch, so the loads pipeline)
            go = True
        if go:
            k = tl.load(kb + n[:, None].to(tl.int64) * k_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            x = tl.where(ok, _logits2(_dot(q, tl.trans(k), None, F.IEEE), scales,
                                      F.SOFTCAP)[0], float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            pr = tl.math.exp2(x - m_ref[:, None])
            alpha = tl.math.exp2(m - m_ref)
            l = l * alpha + tl.sum(pr, 1)
            v = tl.load(vb + n[:, None].to(tl.int64) * v_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + _dot(pr.to(v.dtype), v, None, F.IEEE)
            m = m_new
    some = l > 0
    lse2 = tl.where(some, m + tl.math.log2(tl.where(some, l, 1.0)), float("-inf"))
    o = acc / tl.where(some, l, 1.0)[:, None]
    most = tl.maximum(NSPLIT, NSPLIT_D)  # (the grid's splits)
    if (nsplit == 1) & (sp == 0):
        _store_rows(o_t, LSE, o, lse2 * LN2, b, h, i, rok, HKV * GROUP, SQ, D, F.WITH_LSE)
    elif sp < nsplit:  # (and nsplit > 1)
        # the partial result: rows (bh * most + sp) * BR + r of WS, D values then the lse
        part = WS + ((bh.to(tl.int64) * most + sp) * BR + r)[:, None] * (D + 1)
        tl.store(part + d[None, :], o)
        tl.store(part + D, lse2[:, None])
        tl.debug_barrier()  # every thread's stores before the counter (released at gpu scope)
        if tl.atomic_add(CNT + bh, 1) == nsplit - 1:  # the last split of (b, j): merge
            m = tl.full([BR], float("-inf"), tl.float32)
            tot = tl.zeros([BR], tl.float32)
            acc = tl.zeros([BR, D], tl.float32)
            for t in range(0, nsplit):
                part = WS + ((bh.to(tl.int64) * most + t) * BR + r)[:, None] * (D + 1)
                lt = tl.sum(tl.load(part + D, cache_modifier=".cg"), 1)  # [BR]
                m_new = tl.maximum(m, lt)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_ref)
                w = tl.math.exp2(lt - m_ref)
                tot = tot * alpha + w
                acc = acc * alpha[:, None] + w[:, None] * tl.load(part + d[None, :],
                                                                   cache_modifier=".cg")
                m = m_new
            some = tot > 0
            lse = tl.where(some, (m + tl.math.log2(tl.where(some, tot, 1.0))) * LN2,
                           float("-inf"))
            _store_rows(o_t, LSE, acc / tl.where(some, tot, 1.0)[:, None], lse, b, h, i, rok,
                        HKV * GROUP, SQ, D, F.WITH_LSE)
            tl.atomic_xchg(CNT + bh, 0)  # ready for the next launch


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a split count target); 8 off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 8


class DecodeLauncher:
    """The decode launch of one rule, which every layer of a step calls (and, without position
    tables, every step of a generation): what follows from the layout but the key count (tiles,
    the workspace for the most splits, counters, the compiled kernel) is made by the first call
    of a layout; later calls add their tensors, key count and positions. Launches run one
    after another on a stream (the caller keeps a launcher per stream), so they share the
    workspace and the counters (zero again after every launch)."""

    def __init__(self, rule: Rule, sliding: bool, per_head: bool, has_doc: bool,
                 positions: bool = True, windows: tuple = (), dense: bool = False):
        self.rule, self.flags = rule, (sliding, per_head, has_doc, positions)
        self.windows = windows  # (without position tables: the slots no query reaches skipped)
        self.dense = dense and bool(windows)  # dense heads read more keys than the others
        self._key = self._state = self._kept = self._last = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 out: torch.Tensor, lse=None, interpret: bool = False, softcap: float = 0.0,
                 qbase: int = 0, kdrop: int = 0) -> None:
        """``out`` ``[B, Hq, Sq, D]`` (any strides; ``lse`` ``[B, Hq, Sq]`` float32 if given):
        attention of ``q`` over ``k``/``v`` ``[B, Hkv, Sk, D]`` (``q``'s dtype) where the rule
        allows (a query with no such key: 0 and -inf); scores soft-capped at ``softcap`` where
        it is > 0; ``qbase``, ``kdrop``: the rule's ``QBASE`` / ``KDROP`` (without position
        tables)."""
        last = out if lse is None else lse
        st = (q.stride(), k.stride(), v.stride(), out.stride())
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), last.data_ptr())
        call = (q.shape, k.shape, q.dtype, lse is None, scale, softcap, qbase, kdrop, st)
        moved = ((ptrs[0], *st[0][:3]), (ptrs[1], *st[1][:3]), (ptrs[2], *st[2][:3]),
                 (ptrs[3], *st[3][:3]), ptrs[4])  # the tensors' arguments of a relaunch
        if self._last is not None and self._last[0] == call and not interpret and \
                not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:  # as the call
            # before (the layers of a step), 16-byte aligned: its kernel, grid, new addresses
            kernel, grid, after = self._last[1]
            relaunch(kernel, grid, (*moved, *after))
            return
        key = (q.shape, k.shape[:2], k.shape[3], q.dtype, lse is None, float(scale),
               float(softcap))
        if key != self._key or interpret:
            self._key, self._state, self._kept = key, self._prepare(q, k, lse, scale, softcap,
                                                                    interpret), None
        fn, ints, scales, tail, memo, bn, most, min_tiles = self._state
        now = (k.shape[2], *self._split(k.shape[2], qbase, kdrop, bn, most, min_tiles), qbase,
               kdrop)  # (unspecialised)
        grid = (ints[2] * q.shape[0], max(now[1:3]), 1)
        # what Triton specializes the tensors on besides the key: 16-byte alignments, and each
        # stride's class (1; else a multiple of 16 or not, 32-bit or not): the key count
        # changes a cache's strides every step, not their class
        guard = (*(p & 15 for p in ptrs), *(-1 if x == 1 else (x % 16 == 0) + 2 * (x >> 31)
                                           for s in st for x in s[:3]))
        fresh = self._kept is None or self._kept[0] != guard
        if not fresh:  # a step after the first: the kernel it compiled, this step's integers
            kernel, after = self._kept[1]
            after = (*after[:7], *now, *after[12:])
        else:
            head = (*(Strided(t, *s[:3]) for t, s in zip((q, k, v, out), st)), last)
            found = launch_all([(fn, grid, head, (self.rule, *ints, *now, scales), tail)],
                               memo)
            if found is None:  # (every launch bound: the interpreter)
                return
            kernel, after = found[0][0], found[0][2]
            self._kept = (guard, (kernel, after))
        # (the call before's kernel serves aligned tensors; one that took unaligned ones, none)
        self._last = (call, (kernel, grid, after)) if not any(p & 15 for p in ptrs) else None
        if not fresh:  # (a fresh launch ran in launch_all)
            relaunch(kernel, grid, (*moved, *after))

    def _split(self, sk: int, qbase: int, kdrop: int, bn: int, most: int,
               min_tiles: int) -> tuple:
        """``(NSPLIT, NSPLIT_D)`` for ``sk`` keys in tiles of ``bn``: the splits of a sparse
        head (its key tiles at most those :meth:`_skipped` leaves) and of a dense head, of as
        many tiles each (at least ``min_tiles``; a sparse head's at most ``most``)."""
        ks, kl = self._skipped(qbase, kdrop, bn)
        tiles = -(-max(sk, 1) // bn)
        kept = tiles - (kl - ks) // bn  # a sparse head's key tiles
        per = -(-kept // max(1, min(-(-kept // min_tiles), most)))  # tiles a split
        return -(-kept // per), min(-(-tiles // per), _DENSE_SPLITS * most) if self.dense \
            else -(-kept // per)

    def _skipped(self, qbase: int, kdrop: int, bn: int) -> tuple:
        """``(KS, KL)``: the whole key tiles past the sinks' that no query from position
        ``qbase`` on reaches in any window (sliding: ``qbase - w + 1`` on; segments: from the
        start of ``qbase``'s), ``(0, 0)`` for none; slot ``j >= sinks`` holds ``j + kdrop``."""
        if not self.windows:
            return 0, 0
        sinks = self.rule.SINKS
        first = qbase - max(self.windows) + 1 if self.flags[0] else \
            min(qbase // w * w for w in self.windows)
        ks, kl = -(-sinks // bn) * bn, max(first - kdrop, sinks) // bn * bn
        return (ks, kl) if kl > ks else (0, 0)

    def _prepare(self, q, k, lse, scale, softcap, interpret):
        (B, HQ, SQ, D), HKV = q.shape, k.shape[1]
        group = HQ // HKV
        rows = group * SQ
        br = max(16, 1 << (rows - 1).bit_length())
        bn = 16 if interpret else 64 if D <= 128 else 32  # (head size 256: half the keys)
        most = max(1, min(_MAX_SPLITS, -(-_sms(q.device) // (B * HKV))))
        grid = most * (_DENSE_SPLITS if self.dense else 1)  # the most splits a head takes
        ws = torch.empty(B * HKV * grid * br * (D + 1) if grid > 1 else 1, device=q.device,
                         dtype=torch.float32)
        cnt = torch.zeros(B * HKV, device=q.device, dtype=torch.int32)
        ints = (ws, cnt, HKV, group, SQ, rows)
        tail = dict(BR=br, BN=bn, D=D, NC=self.rule.CFG.shape[0], num_warps=8, num_stages=2,
                    F=DecodeFlags(q.dtype == torch.float32, *self.flags, lse is not None,
                                  softcap > 0))
        return (_decode_kernel, ints, _scales(float(scale), softcap), tail, {}, bn, most,
                1 if interpret else _MIN_TILES)  # ({}: launch_all's memo)
