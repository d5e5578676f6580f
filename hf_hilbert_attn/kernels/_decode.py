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

__all__ = ["DecodeLauncher", "Rule", "DECODE_MAX_ROWS"]

DECODE_MAX_ROWS = 128  # G * Sq rows of one tile
_MIN_TILES, _MAX_SPLITS = 8, 16  # key tiles per split at least, splits at most (the merge
# reads the partial results one after another: docs/decisions.md D54)

# The pattern of a step: int32 positions ``QP [B, Sq]`` / ``KP [B, Sk]`` and document ids ``QD``
# / ``KD`` (the same shapes; a negative key id is padding; the positions again without
# documents), int32 ``CFG [NC, 2]`` (window, rate; ``NC`` a power of two, the first config
# repeated to fill it), int8 ``DENSE [Hkv]`` (1: a dense key/value head), ``SINKS`` sink tokens.
Rule = namedtuple("Rule", "QP KP QD KD CFG DENSE SINKS")


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


@triton.jit(do_not_specialize=["SK", "KPER", "NSPLIT"])
def _decode_kernel(q_t, k_t, v_t, o_t, LSE, rule, WS, CNT, HKV, GROUP, SQ, ROWS, SK, KPER,
                   NSPLIT, scales, BR: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                   NC: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
                   PER_HEAD: tl.constexpr, HAS_DOC: tl.constexpr, WITH_LSE: tl.constexpr,
                   SOFTCAP: tl.constexpr):
    # q_t, k_t, v_t, o_t: ``Strided`` [B, H, S, D]; WS: float32 [B*Hkv*NSPLIT*BR, D + 1];
    # scales: ``_common._logits2``'s
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
    p = tl.load(rule.QP + b * SQ + i, mask=rok, other=0)[:, None]
    if HAS_DOC:
        qd = tl.load(rule.QD + b * SQ + i, mask=rok, other=-2)[:, None]
    dense = tl.load(rule.DENSE + j) != 0  # every key (causal, documents) for this head
    cw, cr, cq, seg, mine = _query_side(p, h[:, None], rule, NC, SLIDING, PER_HEAD)
    kb = k_t.ptr + b * k_t.sb + j.to(tl.int64) * k_t.sh
    vb = v_t.ptr + b * v_t.sb + j.to(tl.int64) * v_t.sh
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    lo = sp * KPER
    hi = tl.minimum(lo + KPER, SK)
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        nok = n < hi
        s = tl.load(rule.KP + b * SK + n, mask=nok, other=0)[None, :]
        ok = (s <= p) & nok[None, :] & rok[:, None]
        if HAS_DOC:
            kd = tl.load(rule.KD + b * SK + n, mask=nok, other=-1)[None, :]
            ok = ok & (kd == qd) & (kd >= 0)
        ok = ok & (_allowed(s, cw, cr, cq, seg, mine, rule.SINKS, SLIDING) | dense)
        if tl.max(tl.max(ok.to(tl.int32), 1), 0) > 0:  # some row attends a key of this tile
            k = tl.load(kb + n[:, None].to(tl.int64) * k_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            x = tl.where(ok, _logits2(_dot(q, tl.trans(k), None, IEEE), scales, SOFTCAP)[0],
                         float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            pr = tl.math.exp2(x - m_ref[:, None])
            alpha = tl.math.exp2(m - m_ref)
            l = l * alpha + tl.sum(pr, 1)
            v = tl.load(vb + n[:, None].to(tl.int64) * v_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + _dot(pr.to(v.dtype), v, None, IEEE)
            m = m_new
    some = l > 0
    lse2 = tl.where(some, m + tl.math.log2(tl.where(some, l, 1.0)), float("-inf"))
    o = acc / tl.where(some, l, 1.0)[:, None]
    if NSPLIT == 1:
        _store_rows(o_t, LSE, o, lse2 * LN2, b, h, i, rok, HKV * GROUP, SQ, D, WITH_LSE)
    else:
        # the partial result: rows (bh * NSPLIT + sp) * BR + r of WS, D values then the lse
        part = WS + ((bh.to(tl.int64) * NSPLIT + sp) * BR + r)[:, None] * (D + 1)
        tl.store(part + d[None, :], o)
        tl.store(part + D, lse2[:, None])
        tl.debug_barrier()  # every thread's stores before the counter (released at gpu scope)
        if tl.atomic_add(CNT + bh, 1) == NSPLIT - 1:  # the last split of (b, j): merge
            m = tl.full([BR], float("-inf"), tl.float32)
            tot = tl.zeros([BR], tl.float32)
            acc = tl.zeros([BR, D], tl.float32)
            for t in range(0, NSPLIT):
                part = WS + ((bh.to(tl.int64) * NSPLIT + t) * BR + r)[:, None] * (D + 1)
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
                        HKV * GROUP, SQ, D, WITH_LSE)
            tl.atomic_xchg(CNT + bh, 0)  # ready for the next launch


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a split count target); 8 off CUDA."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 8


class DecodeLauncher:
    """The decode launch of one plan, which every layer of a step calls: what follows from the
    shapes (tiles, splits, workspace, the compiled kernel) is made by the first call of a
    layout, later calls add only their tensors. Layers run one after another on a stream, so
    they share the workspace and the counters (zero again after every launch)."""

    def __init__(self, rule: Rule, sliding: bool, per_head: bool, has_doc: bool):
        self.rule, self.flags = rule, (sliding, per_head, has_doc)
        self._key = self._state = self._kept = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 out: torch.Tensor, lse=None, interpret: bool = False,
                 softcap: float = 0.0) -> None:
        """``out`` ``[B, Hq, Sq, D]`` (any strides; ``lse`` ``[B, Hq, Sq]`` float32 if given):
        attention of ``q`` over ``k``/``v`` ``[B, Hkv, Sk, D]`` where the rule allows (a query
        with no such key: 0 and -inf); scores soft-capped at ``softcap`` where it is > 0."""
        key = (q.shape, k.shape, q.dtype, lse is None, float(scale), float(softcap))
        if key != self._key or interpret:
            self._key, self._state, self._kept = key, self._prepare(q, k, out, lse, scale,
                                                                    softcap, interpret), None
        ts = (q, k, v, out, out if lse is None else lse)
        strides, ptrs = [t.stride() for t in ts[:4]], [t.data_ptr() for t in ts]
        # what Triton specializes these on besides the key: dtypes, strides, 16-byte alignment
        guard = (*(t.dtype for t in ts[1:]), *strides, *(p & 15 for p in ptrs))
        if self._kept is not None and self._kept[0] == guard:  # a layer after the first
            kernel, grid, after = self._kept[1]
            relaunch(kernel, grid, (*((p, *st[:3]) for p, st in zip(ptrs, strides)), ptrs[4],
                                    *after))
            return
        fn, grid, ints, tail, memo = self._state
        head = (*(Strided(t, *st[:3]) for t, st in zip(ts, strides)), ts[4])
        found = launch_all([(fn, grid, head, (self.rule,) + ints, tail)], memo)
        self._kept = None if found is None else (guard, found[0])

    def _prepare(self, q, k, out, lse, scale, softcap, interpret):
        (B, HQ, SQ, D), (HKV, SK) = q.shape, k.shape[1:3]
        group = HQ // HKV
        rows = group * SQ
        br = max(16, 1 << (rows - 1).bit_length())
        bn = 16 if interpret else 64 if D <= 128 else 32  # (head size 256: half the keys)
        tiles = triton.cdiv(max(SK, 1), bn)
        want = max(1, min(triton.cdiv(tiles, 1 if interpret else _MIN_TILES), _MAX_SPLITS,
                          triton.cdiv(_sms(q.device), B * HKV)))
        per = triton.cdiv(tiles, want) * bn
        nsplit = triton.cdiv(max(SK, 1), per)
        ws = torch.empty(B * HKV * nsplit * br * (D + 1) if nsplit > 1 else 1, device=q.device,
                         dtype=torch.float32)
        cnt = torch.zeros(B * HKV, device=q.device, dtype=torch.int32)
        ints = (ws, cnt, HKV, group, SQ, rows, SK, per, nsplit, _scales(float(scale), softcap))
        tail = dict(zip(("SLIDING", "PER_HEAD", "HAS_DOC"), self.flags), BR=br, BN=bn, D=D,
                    NC=self.rule.CFG.shape[0], IEEE=q.dtype == torch.float32,
                    WITH_LSE=lse is not None, SOFTCAP=softcap > 0, num_warps=8, num_stages=2)
        return _decode_kernel, (B * HKV, nsplit), ints, tail, {}  # {}: launch_all's memo
