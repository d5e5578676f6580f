"""Device helpers shared by the forward and backward kernels.

Position space (docs/kernels.md): a tile of config ``(W, R)`` is ``BLOCK`` positions
``seg*W + c + R*n`` of one class ``c`` of one segment ``seg``, so every pair of a (query tile,
key tile) is allowed by the config; the only masks left are the causal diagonal, range ends,
absent positions, documents and the *union* rule (a pair belongs to the first config in
priority order, ``CFG[0:NPRI]``, that allows it). Sliding windows (``SLIDING``) have no
segments: a tile is one class of the whole sequence and a key is allowed within ``LB = (w - 1)
// r`` class steps of the query (a band, whose edges are masked like the diagonal). Sink tokens
(last in priority) are one more key run of the last launch: positions ``< SINKS``, with the
union mask against every config (``NCFG``).

All divisions and remainders act on non-negative integers: Triton's ``//`` truncates while the
interpreter floors, and the two only agree there.
"""

from collections import namedtuple

import triton
import triton.language as tl

# exp(x) = exp2(x * LOG2E) and ln(y) = log2(y) * LN2: the kernels keep the softmax in base 2.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# What a launch takes besides its tiles (BM, BN, D), grouped so each kernel has about 20
# parameters (docs/kernels.md, "Kernel arguments"):
# * a tensor as (pointer, batch stride, head stride, row stride); its last stride is 1;
Strided = namedtuple("Strided", "ptr sb sh ss")
# * the position maps (positions -> storage rows) and document ids (int32 [B or 1, S]) of the
#   call, with their batch strides;
Positions = namedtuple("Positions", "QINV sqinv KINV skinv QDOC sqdoc KDOC skdoc")
# * the compile-time flags (one tl.constexpr ``F``); MAPPED: 1 permuted, 2 with gaps; UTAB: the
#   earlier configs in the union key tables (0: runtime loop); MIXED: ``_calls._may_mix``;
#   SINK: forward and dq attend the sink keys, dk/dv add their sums; SOFTCAP: soft-capped
#   scores (``_logits2``); HAS_DLSE: dq's delta takes the lse's gradient (set at launch: the
#   plan serves calls with and without one);
Flags = namedtuple("Flags", "CAUSAL PER_HEAD MAPPED HAS_DOC IEEE SLIDING UTAB EARLIER MIXED SINK "
                   "SOFTCAP HAS_DLSE")
# * the integers the key loops read (``_SCALARS``) as unspecialised arguments: in the constant
#   bank they take no register through the loops. The others (``LAUNCH_FIELDS``) are one int32
#   row per launch of a table made with the call's plan: as arguments Triton would specialise
#   them (``do_not_specialize`` does not reach into tuples) while they vary with the pattern,
#   config and positions; from the table, one set of compiled kernels serves every pattern.
#   ``_launch_scalars`` reads them before the key loops, ``_launch_sinks`` and
#   ``_launch_order`` after.
_SCALARS = ["R", "LB", "LC", "NPRI", "PSZ", "GROUP", "QOFF"]
LAUNCH_FIELDS = ("HOFF", "HCH", "HBASE",
                 "KOFF", "QLO", "QHI", "KLO", "KHI",
                 "SEG0", "NCLS", "NBLK", "BLK0", "W",
                 "SINKS", "SKLO", "SKHI", "NCFG",
                 "NLAUNCHED", "FIRST", "LAST")
LAUNCH_ROW = 32  # int32 per row: every row 16-byte aligned (Triton specialises on alignment)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in float32 (``acc`` None: ``a @ b``); ``IEEE``: float32 inputs multiplied
    in full float32 precision, not Triton's default TF32."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tanh(x):
    """``tanh`` in float32 to a few units in the last place (Triton's interpreter runs no
    libdevice ``tanh``): an odd series below 0.3, where ``(1 - e) / (1 + e)`` with ``e =
    exp(-2|x|)`` would lose digits to the subtraction, that form above (rounding of ``e`` is
    then at most 2.7e-7 of the result)."""
    a = tl.abs(x)
    e = tl.math.exp2(a * (-2.0 * LOG2E))
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315 + a2 * (
        62.0 / 2835 + a2 * (-1382.0 / 155925))))))
    t = tl.where(a < 0.3, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


def _scales(scale: float, softcap: float) -> tuple:
    """A launch's ``scales`` (``_logits2``) on the host: ``(scale, scale * log2(e), scale / cap,
    cap * log2(e))``; the last two unread without soft-capping (``softcap`` 0)."""
    cap = softcap or 1.0
    return (scale, scale * LOG2E.value, scale / cap, cap * LOG2E.value)


@triton.jit
def _logits2(s, scales, SOFTCAP: tl.constexpr):
    """Base-2 logits of a tile's dot products ``s`` and the factor the backward's ``dS`` takes.
    ``scales``: ``(scale, scale * log2(e), scale / cap, cap *
    log2(e))``; soft-capped (Gemma 2), a logit is ``cap * tanh(scale * s / cap)``, whose
    derivative by ``scale * s`` is ``1 - tanh**2`` (without a cap: unread)."""
    if SOFTCAP:
        t = _tanh(s * scales[2])
        x, dx = t * scales[3], 1.0 - t * t
    else:
        x = s * scales[1]
        dx = x  # (unread: one return type for both branches, as Triton's compiler needs)
    return x, dx


@triton.jit
def _launch_scalars(L):
    """The integers a launch reads before its key loops, from its row ``L``: heads ``(HOFF,
    HCH, HBASE)``, span ``(KOFF, QLO, QHI, KLO, KHI)``, tiles ``(SEG0, NCLS, NBLK, BLK0, W)``
    (``LAUNCH_FIELDS``)."""
    return (tl.load(L + 0), tl.load(L + 1), tl.load(L + 2), tl.load(L + 3), tl.load(L + 4),
            tl.load(L + 5), tl.load(L + 6), tl.load(L + 7), tl.load(L + 8), tl.load(L + 9),
            tl.load(L + 10), tl.load(L + 11), tl.load(L + 12))


@triton.jit
def _kv_program(HOFF, HCH, HBASE, SEG0, NCLS, NBLK, BLK0, W, R, GROUP, PER_HEAD: tl.constexpr):
    """A dk/dv program's place from its ids and its launch's integers: ``(b, hkl, hk, blk,
    sbase, ncl, c)``, its batch, key/value head within the launch's chunk (the float32 sums hold
    ``HCH`` heads) and overall, key block, its class's first position in its segment, the class's
    length and the class (per_head: of the group's query heads the launch reads)."""
    tile = tl.program_id(0)
    bhk = tl.program_id(1)
    hkl = bhk % HCH
    t2 = tile // NBLK
    c = ((HOFF + hkl) * GROUP + HBASE + t2 % NCLS) % R if PER_HEAD else t2 % NCLS
    return (bhk // HCH, hkl, HOFF + hkl, BLK0 + tile % NBLK, (SEG0 + t2 // NCLS) * W + c,
            (W - c + R - 1) // R, c)


@triton.jit
def _launch_sinks(L):
    """``(SINKS, SKLO, SKHI, NCFG)`` of a launch from its row ``L``: read after the key loop,
    before the sink keys' (``_launch_order``)."""
    return tl.load(L + 13), tl.load(L + 14), tl.load(L + 15), tl.load(L + 16)


@triton.jit
def _launch_order(L):
    """``(NLAUNCHED, FIRST, LAST)`` of a launch from its row ``L``. The kernels read the
    integers they need after the key loops there: loaded before a loop, a value holds a
    register all through it, where an argument is read from the constant bank (a forward with
    sink keys and sliding windows: 193 registers with all of them read before the loops, 164
    as arguments; docs/decisions.md)."""
    return tl.load(L + 17), tl.load(L + 18), tl.load(L + 19)


@triton.jit
def _row_ptrs(t, b64, h, rows, D: tl.constexpr):
    """``[len(rows), D]`` pointers of rows ``rows`` of head ``h``, batch ``b64`` of ``t``."""
    return (t.ptr + b64 * t.sb + h.to(tl.int64) * t.sh + rows.to(tl.int64)[:, None] * t.ss
            + tl.arange(0, D)[None, :])


@triton.jit
def _n_range(sbase, ncl, LO, HI, R):
    """Class indices ``n`` whose position ``sbase + R*n`` lies in ``[LO, HI]``: ``[lo, hi)``."""
    lo = (tl.maximum(LO - sbase, 0) + R - 1) // R
    hi = tl.where(HI >= sbase, tl.maximum(HI - sbase, 0) // R + 1, 0)
    hi = tl.minimum(hi, ncl)
    return lo, hi


@triton.jit
def _program_tile(tile, bh, HOFF, HCH, HBASE, GROUP, SEG0, NCLS, NBLK, BLK0, W, R,
                  PER_HEAD: tl.constexpr):
    """Program ids of a query-side kernel (forward, dq) → its tile: batch ``b``, head ``h`` (``hl``
    within the launch's chunk of heads, ``hk`` its key/value head, ``hc`` its number in the
    pattern's rule: ``h + HBASE``, ``HBASE`` the first head of a head-sharded rank), class-index
    block ``blk``, and the position ``sbase`` of class index 0 of its segment and class, which
    holds ``ncl`` positions. Grid: ``(segments * classes * blocks, B * heads in the chunk)``;
    per_head mode has one class per head (``hc % R``)."""
    b = bh // HCH
    hl = bh % HCH  # head within this launch's chunk of heads (the float32 buffer holds HCH)
    h = HOFF + hl
    hc = h + HBASE
    hk = h // GROUP
    blk = BLK0 + tile % NBLK
    t2 = tile // NBLK
    seg = SEG0 + t2 // NCLS
    if PER_HEAD:
        c = hc % R
    else:
        c = t2 % NCLS
    sbase = seg * W + c  # position of class index n = 0
    ncl = (W - c + R - 1) // R  # positions of class c in a (full) segment
    return b, hl, h, hc, hk, blk, sbase, ncl


@triton.jit
def _query_rows(b, blk, sbase, ncl, R, QLO, QHI, QOFF, QINV, sqinv, BM: tl.constexpr,
                MAPPED: tl.constexpr):
    """The tile's query rows: class indices ``offs_m`` (``[qn_lo, qn_hi)`` exist), positions
    ``pq``, ``row_ok`` and storage rows ``qidx`` (0 where not ok; ``b64`` = ``b`` as int64)."""
    qn_lo, qn_hi = _n_range(sbase, ncl, QLO, QHI, R)
    offs_m = blk * BM + tl.arange(0, BM)
    pq = sbase + R * offs_m  # [BM] positions
    row_ok = (offs_m >= qn_lo) & (offs_m < qn_hi)
    b64 = b.to(tl.int64)
    if MAPPED:
        qidx = tl.load(QINV + b64 * sqinv + pq, mask=row_ok, other=-1)
        row_ok = row_ok & (qidx >= 0)
    else:
        qidx = pq - QOFF
    qidx = tl.where(row_ok, qidx, 0)
    return b64, offs_m, pq, row_ok, qidx, qn_lo, qn_hi


@triton.jit
def _key_range(blk, sbase, ncl, R, qn_lo, qn_hi, KLO, KHI, LB, LC, BM: tl.constexpr,
               CAUSAL: tl.constexpr, SLIDING: tl.constexpr):
    """Key class indices ``[kn_lo, kn_hi)`` of a query tile: same segment and class (sliding:
    the band of ``LB`` class steps before each query, after it too when not causal; causal: up
    to the last query, less the ``LC`` class steps earlier configs own). Returns ``(kn_lo, kn_hi, full_hi, band_lo, m_first, m_last, pq0, pq1)``:
    keys below ``full_hi`` need no diagonal mask, keys from ``band_lo`` on lie inside every
    query's window (lower side), ``[m_first, m_last]`` are the tile's existing queries (none
    when ``m_last < m_first``: an empty key range) at positions ``[pq0, pq1]``."""
    kn_lo, kn_hi = _n_range(sbase, ncl, KLO, KHI, R)
    m_first = tl.maximum(blk * BM, qn_lo)
    m_last = tl.minimum(blk * BM + BM, qn_hi) - 1
    band_lo = 0
    if SLIDING:
        kn_lo = tl.maximum(kn_lo, m_first - LB)
        band_lo = blk * BM + BM - 1 - LB
        if not CAUSAL:
            kn_hi = tl.minimum(kn_hi, m_last + LB + 1)
    if CAUSAL:
        kn_hi = tl.minimum(kn_hi, m_last + 1 - LC)  # keys n <= the last query's n - LC
        full_hi = tl.minimum(kn_hi, blk * BM + 1 - LC)  # below: no diagonal inside the tile
    else:
        full_hi = kn_hi
        if SLIDING:
            full_hi = tl.minimum(kn_hi, blk * BM + LB + 1)  # below: inside every window
    kn_hi = tl.where(m_last >= m_first, kn_hi, kn_lo)  # no query: empty loop
    pq0 = sbase + R * m_first
    pq1 = sbase + R * tl.maximum(m_last, m_first)
    return kn_lo, kn_hi, full_hi, band_lo, m_first, m_last, pq0, pq1


@triton.jit
def _kv_bases(k, v, KDOC, b64, hk, KOFF, MAPPED: tl.constexpr):
    """Base pointers of key/value head ``hk`` (``k``, ``v``: ``Strided``) and the key document
    ids: natural keys (storage index = position - ``KOFF``) have the offset folded in, so a key
    tile indexes by position."""
    k_base = k.ptr + b64 * k.sb + hk.to(tl.int64) * k.sh
    v_base = v.ptr + b64 * v.sb + hk.to(tl.int64) * v.sh
    kdoc = KDOC
    if MAPPED == 0:
        k_base = k_base - KOFF.to(tl.int64) * k.ss
        v_base = v_base - KOFF.to(tl.int64) * v.ss
        kdoc = KDOC - KOFF
    return k_base, v_base, kdoc


@triton.jit
def _key_tile(start_n, end, sbase, R, b64, keys, BN: tl.constexpr, D: tl.constexpr,
              EDGE: tl.constexpr, MAPPED: tl.constexpr):
    """Load the key tile at class indices ``start_n + [0, BN)`` (keys ``n < end`` exist) of a
    query-side kernel: ``(offs_n, pk, col_ok, kidx, k, v)`` with positions ``pk`` and storage
    rows ``kidx`` (0 where not ``col_ok``). ``keys``: ``(k_base, v_base, KINV, KDOC, skinv,
    skdoc, sks, svs)``. Loads are masked only on ``EDGE`` tiles and partial maps
    (``MAPPED == 2``: absent positions)."""
    k_base, v_base, KINV, KDOC, skinv, skdoc, sks, svs = keys
    offs_d = tl.arange(0, D)
    offs_n = start_n + tl.arange(0, BN)
    pk = sbase + R * offs_n
    col_ok = offs_n < end
    if MAPPED:
        kidx = tl.load(KINV + b64 * skinv + pk, mask=col_ok, other=-1)
        col_ok = col_ok & (kidx >= 0)
        kidx = tl.where(col_ok, kidx, 0)
        first, rows = 0, kidx.to(tl.int64)[:, None]
    else:
        # natural positions: rows R apart from the tile's first, whose offset is one number, so
        # the rows' own offsets are the same at every tile (hoisted out of the key loop: no
        # 64-bit address arithmetic per element and step; masked rows are not read)
        kidx = tl.where(col_ok, pk, 0) if EDGE else pk
        first = tl.cast(sbase + R * start_n, tl.int64)  # (an int in the interpreter)
        rows = (R * tl.arange(0, BN)).to(tl.int64)[:, None]
    ok = col_ok[:, None] if EDGE or MAPPED == 2 else None
    k = tl.load((k_base + first * sks) + (rows * sks + offs_d[None, :]), mask=ok,
                other=0.0 if EDGE or MAPPED == 2 else None)
    v = tl.load((v_base + first * svs) + (rows * svs + offs_d[None, :]), mask=ok,
                other=0.0 if EDGE or MAPPED == 2 else None)
    return offs_n, pk, col_ok, kidx, k, v


@triton.jit
def _union_keep(pq, pk, p0, p1, R, h, CFG, NPRI, PER_HEAD: tl.constexpr,
                SLIDING: tl.constexpr, SINK: tl.constexpr):
    """Per-pair union mask: True where no earlier config allows the pair.

    ``pq`` and ``pk`` are broadcastable int32 position tensors (``[M, 1]`` and ``[1, N]`` or
    transposed); the result has their broadcast shape. ``[p0, p1]`` is the position range of
    the program's own side: an earlier config whose segment holds all of it and whose rate
    divides ``R`` is settled by the skipped interval of ``_covered`` and is not tested here
    (sliding: only a config whose class is never this head's is settled). ``SINK`` (the sink
    keys, positions below ``p1``, against rows from position ``p0`` on): a config is settled
    where every row is a window (a segment) away from every sink key, or, per_head, where no
    sink key is of the head's class.
    Each config costs one compare per pair: a (segment, class) key per row and column
    (sliding: the window and the class). A runtime loop over the configs: unrolled, it spilled
    (decisions.md, "One union test in a loop"). Patterns with up to four earlier configs
    and no sliding window test pairs through the key tables instead (``_union_tab``).
    """
    covered = (pq < 0) | (pk < 0)  # all False, broadcast shape
    for j in range(NPRI):
        wj = tl.load(CFG + 2 * j)
        rj = tl.load(CFG + 2 * j + 1)
        if SINK:
            settled = p0 - p1 + 1 >= wj
            if PER_HEAD:
                settled = settled | ((p1 <= rj) & (h % rj >= p1))
        elif SLIDING:
            if PER_HEAD:
                settled = ((R % rj) == 0) & ((p0 % rj) != (h % rj))
            else:
                settled = p0 < 0
        else:
            settled = ((p0 // wj) == (p1 // wj)) & ((R % rj) == 0)
        if SLIDING:
            if settled == 0:
                cq = pq % rj
                hit = ((pq - pk) < wj) & ((pk - pq) < wj) & (cq == (pk % rj))
                if PER_HEAD:
                    hit = hit & (cq == (h % rj))
                covered = covered | hit
        else:
            if settled == 0:
                tq = pq % wj
                cq = tq % rj
                kq = (pq - tq) // wj * rj + cq
                if PER_HEAD:
                    kq = tl.where(cq == (h % rj), kq, -1)
                tk = pk % wj
                covered = covered | (kq == (pk - tk) // wj * rj + (tk % rj))
    return covered == 0


@triton.jit
def _participates(pq, h, nh, LCFG, NL, PER_HEAD: tl.constexpr, SLIDING: tl.constexpr):
    """Rows (positions ``pq``) that take part in any of the configs ``LCFG[0:NL]`` for one of
    the heads ``h .. h + nh - 1`` (a query head: ``nh`` 1; a key row: its group's query heads).

    Those are the rows an earlier launch already wrote a partial result for (the sink launch is
    entered as ``(W, 1)``: every row).
    """
    part = (pq < 0)
    for j in range(NL):
        wj = tl.load(LCFG + 2 * j)
        rj = tl.load(LCFG + 2 * j + 1)
        if PER_HEAD:
            cls = pq % rj if SLIDING else (pq % wj) % rj
            # the class's distance above the first head's, in [0, rj): within the heads?
            part = part | ((cls + rj - h % rj) % rj < nh)
        else:
            part = part | (pq >= 0)
    return part


@triton.jit
def _idx_from(x, sbase, R):
    """First class index ``n`` with ``sbase + R*n >= x`` (0 below ``sbase``)."""
    return (tl.maximum(x - sbase, 0) + R - 1) // R


@triton.jit
def _idx_after(x, sbase, R):
    """First class index ``n`` with ``sbase + R*n > x`` (0 below ``sbase``)."""
    return tl.where(x >= sbase, tl.maximum(x - sbase, 0) // R + 1, 0)


@triton.jit
def _covered(p0, p1, sbase, R, h, empty_at, CFG, NPRI, PER_HEAD: tl.constexpr,
             SLIDING: tl.constexpr, CAUSAL: tl.constexpr, KSIDE: tl.constexpr):
    """Range ``[ca, cb)`` of class indices of the *other* side covered by earlier configs.

    One side of a tile holds positions ``[p0, p1]`` (all congruent modulo ``R``); the other side
    runs over positions ``sbase + R*n``. An earlier config whose segment holds the whole first
    side, and whose rate divides ``R`` (one class for all), covers every pair with a position
    of that segment (same class) or none (per_head, another head's class). Those segments all
    contain ``[p0, p1]``, so their union is one interval. Returns ``(ca, cb, ma, mb)``;
    ``ca == cb == empty_at`` when nothing is covered, and ``[ma, mb)`` the hull of the other
    side's class indices where an earlier config that needs the per-pair union mask (segment
    boundary inside the tile, or rate not dividing ``R``) could cover a pair: the config's
    segments that hold a position of ``[p0, p1]`` (its own segment; the two around the
    boundary when the tile straddles one); empty (``ma > mb``) when no config needs it. The
    union mask is needed nowhere else on whole tiles, and the kernels apply it only there.
    Whether a launch can have a program with such a config at all is decided on the host
    (``_calls._may_mix``, the kernels' ``MIXED``).

    Sliding windows (``SLIDING``): a config whose rate divides ``R`` (this head's class) covers
    for the whole tile the other side's positions within its window of every position of
    ``[p0, p1]`` — ``[p1 - w + 1, p0 + w - 1]``; causal, pairs past the diagonal are masked
    anyway, so the interval is open upwards for a query tile and downwards for a key tile
    (``KSIDE``). The windows are nested around the tile, so their union is one interval; the
    pairs only some positions of the tile reach (the window's edge) need the per-pair mask.
    Causal, the covered interval therefore starts at 0 for a key tile and ends at ``empty_at``
    for a query tile (also when nothing is covered), so one of the two ranges around it is
    always empty.
    """
    ca = empty_at + 0 * p0
    if SLIDING and CAUSAL and KSIDE:
        ca = 0 * p0  # nothing covered: an empty interval at 0 (see the note below)
    cb = ca
    ma = empty_at + 0 * p0
    mb = 0 * p0
    found = p0 < 0  # False
    for j in range(NPRI):
        wj = tl.load(CFG + 2 * j)
        rj = tl.load(CFG + 2 * j + 1)
        uniform = (R % rj) == 0
        if SLIDING:
            if PER_HEAD:
                cls_ok = (p0 % rj) == (h % rj)
            else:
                cls_ok = p0 >= 0
            full = uniform & cls_ok
            none = uniform & (cls_ok == 0)
            if CAUSAL:
                if KSIDE:  # queries at or after the tile's keys
                    lo = 0 * p0
                    hi = tl.minimum(_idx_after(p0 + wj - 1, sbase, R), empty_at)
                    mlo = _idx_from(p0, sbase, R)
                    mhi = _idx_after(p1 + wj - 1, sbase, R)
                else:
                    lo = _idx_from(p1 - wj + 1, sbase, R)
                    hi = empty_at + 0 * p0
                    mlo = _idx_from(p0 - wj + 1, sbase, R)
                    mhi = _idx_after(p1, sbase, R)
            else:
                lo = _idx_from(p1 - wj + 1, sbase, R)
                hi = tl.minimum(_idx_after(p0 + wj - 1, sbase, R), empty_at)
                mlo = _idx_from(p0 - wj + 1, sbase, R)
                mhi = _idx_after(p1 + wj - 1, sbase, R)
            full = full & (lo < hi)
            mix_j = none == 0
            ma = tl.where(mix_j, tl.minimum(ma, mlo), ma)
            mb = tl.where(mix_j, tl.maximum(mb, mhi), mb)
        else:
            qa = p0 // wj
            qb = p1 // wj
            uniform = uniform & (qa == qb)
            if PER_HEAD:
                cls_ok = ((p0 - qa * wj) % rj) == (h % rj)
            else:
                cls_ok = p0 >= 0
            full = uniform & cls_ok
            none = uniform & (cls_ok == 0)
            mix_j = (full == 0) & (none == 0)
            lo = _idx_from(qa * wj, sbase, R)
            hi = _idx_from((qa + 1) * wj, sbase, R)
            # config j covers only pairs inside one of its segments: those that hold a position
            # of [p0, p1] (one; two when the first side straddles a boundary)
            ma = tl.where(mix_j, tl.minimum(ma, lo), ma)
            mb = tl.where(mix_j, tl.maximum(mb, _idx_from((qb + 1) * wj, sbase, R)), mb)
        ca = tl.where(full, tl.where(found, tl.minimum(ca, lo), lo), ca)
        cb = tl.where(full, tl.where(found, tl.maximum(cb, hi), hi), cb)
        found = found | full
    return ca, cb, ma, mb


@triton.jit
def _sink_geometry(pq, pq1, m_first, m_last, R, SKLO, SKHI, CAUSAL: tl.constexpr):
    """``(offs, p0, p1, sbase, R, LB, band_lo, hi)`` that make a tile loop walk the sink keys at
    consecutive positions ``0, 1, ..``: rows indexed by their positions (the causal mask then
    compares positions), the rows' first position (rows ``R`` apart up to ``pq1``) and the
    sink keys' end as the union test's ``p0`` and ``p1`` (``_union_keep``'s ``SINK`` form
    settles the configs that reach no sink pair of the program), a window reaching everything,
    and the end of the sink keys ``[SKLO, hi)`` this program attends (causal: up to its last
    row ``pq1``; none for a program without rows)."""
    hi = SKHI
    if CAUSAL:
        hi = tl.minimum(hi, pq1 + 1)
    p0 = pq1 - R * tl.maximum(m_last - m_first, 0)
    return pq, p0, SKHI, 0, 1, 1073741823, 0, tl.where(m_last >= m_first, hi, SKLO)


@triton.jit
def _band_split(lo, full_hi, end, band_lo, BN: tl.constexpr):
    """Tile starts ``lo <= b1 <= mid <= end`` of a key run ``[lo, end)`` (steps of ``BN``):
    ``[lo, b1)`` masked (sliding: keys below some query's window; ``band_lo <= lo`` leaves it
    empty), ``[b1, mid)`` whole tiles below ``full_hi`` (no diagonal), ``[mid, end)`` masked."""
    b1 = tl.minimum(lo + (tl.maximum(band_lo - lo, 0) + BN - 1) // BN * BN, end)
    b1 = tl.maximum(b1, lo)
    mid = b1 + tl.maximum(tl.minimum(end, full_hi) - b1, 0) // BN * BN
    return b1, mid


@triton.jit
def _band_tail(mid, end, band_hi, BM: tl.constexpr):
    """Key-side programs (dk/dv): the whole query tiles from ``mid`` end where a tile would
    reach past ``band_hi`` (sliding: queries beyond some key's window); masked from there."""
    # a tile is whole when its rows below ``end`` all lie below ``band_hi``
    return tl.where(end <= band_hi, end,
                    tl.minimum(mid + tl.maximum(band_hi - mid, 0) // BM * BM, end))


@triton.jit
def _split_at(s0, e, ma, mb, BN: tl.constexpr):
    """Tile starts ``s0 <= x1 <= x2 <= e`` (steps of ``BN`` from ``s0``): the tiles of
    ``[x1, x2)`` are those that meet ``[ma, mb)``."""
    x1 = tl.minimum(s0 + tl.maximum(ma - s0, 0) // BN * BN, e)
    x2 = tl.maximum(tl.minimum(s0 + (tl.maximum(mb - s0, 0) + BN - 1) // BN * BN, e), x1)
    return x1, x2


@triton.jit
def _prog_key(j: tl.constexpr, p, ok, p0, p1, R, h, CFG, NPRI, KEYS, PSZ,
              PER_HEAD: tl.constexpr):
    """(segment, class) keys of earlier config ``j`` for the program's own positions ``p``.

    Read from the host table ``KEYS[j, pos] = (pos // w_j) * r_j + (pos % w_j) % r_j``; ``-1``
    (never equal to a table entry) where the config is settled for the whole program (see
    ``_union_keep``), absent, or in per_head mode of another head's class. A pair is covered
    by config ``j`` iff both keys are equal, so the per-pair test is one compare.
    """
    live = NPRI > j
    wj = tl.load(CFG + 2 * j)  # j < UTAB <= number of priority configs - 1: always in the table
    rj = tl.load(CFG + 2 * j + 1)
    settled = ((p0 // wj) == (p1 // wj)) & ((R % rj) == 0)
    use = ok & live & (settled == 0) & (p < PSZ)
    # (the mask goes through a vector compare: the interpreter rejects an int-typed mask here)
    key = tl.load(KEYS + j * PSZ + p, mask=tl.where(use, p, -1) >= 0, other=-1)
    if PER_HEAD:
        key = tl.where((key >= 0) & ((key % rj) == (h % rj)), key, -1)
    return key


@triton.jit
def _row_keep(offs_m, offs_n, pq, pk, col_ok, qd, kidx, uni, p0, p1, R, h, b64, LB, LC, keys,
              EDGE: tl.constexpr, UNION: tl.constexpr, UTAB: tl.constexpr, F: tl.constexpr):
    """The ``[BM, BN]`` mask of a tile of queries (rows) and keys (columns) in the forward and
    dq loops: real keys of real rows; on ``EDGE`` tiles the diagonal, moved back by the ``LC``
    class steps earlier configs own (``n_k <= n_q - LC``), and the window (``n_q - LB <= n_k``,
    ``<= n_q + LB`` non-causal); on ``UNION`` tiles no earlier config
    covering the pair (``uni``: the tables' keys or the runtime loop; ``UTAB`` -1: the sink
    keys' run, the loop's ``SINK`` form); the same document."""
    CFG, NPRI, KEYS, PSZ, kp0, kp1, kp2, kp3 = uni
    keep = col_ok[None, :] & (offs_m[:, None] >= 0)
    if F.CAUSAL and EDGE:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] - LC)
    if F.SLIDING and EDGE:
        keep = keep & (offs_n[None, :] >= offs_m[:, None] - LB)
        if not F.CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + LB)
    if UNION:
        if UTAB > 0:
            keep = keep & _union_tab(kp0, kp1, kp2, kp3, KEYS, PSZ, pk, UTAB=UTAB)
        else:
            keep = keep & _union_keep(pq[:, None], pk[None, :], p0, p1, R, h, CFG, NPRI,
                                      PER_HEAD=F.PER_HEAD, SLIDING=F.SLIDING, SINK=UTAB < 0)
    if F.HAS_DOC:
        kd = tl.load(keys[3] + b64 * keys[5] + kidx, mask=col_ok, other=-1)
        keep = keep & (qd[:, None] == kd[None, :]) & (kd[None, :] >= 0)
    return keep


@triton.jit
def _union_prologue(p, ok, p0, p1, sbase, R, h, empty_at, CFG, NPRI, KEYS, PSZ,
                    UTAB: tl.constexpr, F: tl.constexpr, KSIDE: tl.constexpr):
    """What a config with earlier configs needs before its loops: the positions they cover
    for the whole program and the part of them that needs the per-pair mask (``_covered``),
    and the union arguments of the span loops, with the program-side keys of up to four earlier
    configs (``_prog_key``; -1 = none)."""
    ca, cb, ma, mb = _covered(p0, p1, sbase, R, h, empty_at, CFG, NPRI, PER_HEAD=F.PER_HEAD,
                              SLIDING=F.SLIDING, CAUSAL=F.CAUSAL, KSIDE=KSIDE)
    kp0 = p * 0 - 1
    kp1 = kp0
    kp2 = kp0
    kp3 = kp0
    if UTAB > 0:
        kp0 = _prog_key(0, p, ok, p0, p1, R, h, CFG, NPRI, KEYS, PSZ, PER_HEAD=F.PER_HEAD)
    if UTAB > 1:
        kp1 = _prog_key(1, p, ok, p0, p1, R, h, CFG, NPRI, KEYS, PSZ, PER_HEAD=F.PER_HEAD)
    if UTAB > 2:
        kp2 = _prog_key(2, p, ok, p0, p1, R, h, CFG, NPRI, KEYS, PSZ, PER_HEAD=F.PER_HEAD)
    if UTAB > 3:
        kp3 = _prog_key(3, p, ok, p0, p1, R, h, CFG, NPRI, KEYS, PSZ, PER_HEAD=F.PER_HEAD)
    return ca, cb, ma, mb, (CFG, NPRI, KEYS, PSZ, kp0, kp1, kp2, kp3)


@triton.jit
def _union_tab(kp0, kp1, kp2, kp3, KEYS, PSZ, p_it, UTAB: tl.constexpr):
    """Per-pair union mask from program-side keys ``kp*`` (rows) and the table entries of the
    iterated positions ``p_it`` (columns): True where no earlier config covers the pair."""
    inr = p_it < PSZ
    cov = kp0[:, None] == tl.load(KEYS + p_it, mask=inr, other=-2)[None, :]
    if UTAB > 1:
        cov = cov | (kp1[:, None] == tl.load(KEYS + PSZ + p_it, mask=inr, other=-2)[None, :])
    if UTAB > 2:
        cov = cov | (kp2[:, None] == tl.load(KEYS + 2 * PSZ + p_it, mask=inr, other=-2)[None, :])
    if UTAB > 3:
        cov = cov | (kp3[:, None] == tl.load(KEYS + 3 * PSZ + p_it, mask=inr, other=-2)[None, :])
    return cov == 0
