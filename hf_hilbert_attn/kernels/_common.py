"""Device helpers shared by the forward and backward kernels.

Position space (DESIGN §4): a tile of config ``(W, R)`` is ``BLOCK`` positions of one dilation
class ``c`` of one segment ``seg``: ``seg*W + c + R*n`` for consecutive ``n``. Every pair
inside such a (query tile, key tile) is allowed by the config (same segment, same class), so
the only masks left are the causal diagonal, range ends, absent positions, documents and the
*union* rule: a pair belongs to the first config (in priority order, ``CFG[0:NPRI]``) that
allows it, so later configs mask pairs an earlier one already covers.

All divisions and remainders here act on non-negative integers: Triton's ``//`` truncates
while the interpreter floors, and the two only agree there.
"""

import triton
import triton.language as tl


@triton.jit
def _n_range(sbase, ncl, LO, HI, R):
    """Class indices ``n`` whose position ``sbase + R*n`` lies in ``[LO, HI]``: ``[lo, hi)``."""
    lo = (tl.maximum(LO - sbase, 0) + R - 1) // R
    hi = tl.where(HI >= sbase, tl.maximum(HI - sbase, 0) // R + 1, 0)
    hi = tl.minimum(hi, ncl)
    return lo, hi


@triton.jit
def _classify(pq0, pq1, pk0, pk1, h, R, CFG, NPRI, PER_HEAD: tl.constexpr):
    """Scalar union test of a (query range, key range) tile against the earlier configs.

    Queries lie in positions ``[pq0, pq1]`` and keys in ``[pk0, pk1]``, all of one class of the
    current config (so every position is congruent modulo ``R``). Returns ``(skip, mixed)``:
    ``skip`` when one earlier config covers every pair (the tile is not computed), ``mixed``
    when some earlier config may cover some pairs (the per-pair union mask is needed).
    """
    skip = pq0 < 0  # False, as a scalar tensor
    mixed = pq0 < 0
    for j in range(NPRI):
        wj = tl.load(CFG + 2 * j)
        rj = tl.load(CFG + 2 * j + 1)
        qa = pq0 // wj
        qb = pq1 // wj
        ka = pk0 // wj
        kb = pk1 // wj
        disjoint = (kb < qa) | (qb < ka)
        single = (qa == qb) & (ka == kb) & (qa == ka)
        # R % rj == 0: all positions of the tile share one class modulo rj, and p ≡ s (mod rj).
        uniform = (R % rj) == 0
        if PER_HEAD:
            cls_ok = ((pq0 - qa * wj) % rj) == (h % rj)
            full = single & uniform & cls_ok
            none = disjoint | (uniform & (qa == qb) & (cls_ok == 0))
        else:
            full = single & uniform
            none = disjoint
        skip = skip | full
        mixed = mixed | ((full == 0) & (none == 0))
    return skip, mixed


@triton.jit
def _union_keep(pq, pk, h, CFG, NPRI, PER_HEAD: tl.constexpr):
    """Per-pair union mask: True where no earlier config allows the pair.

    ``pq`` and ``pk`` are broadcastable int32 position tensors (``[M, 1]`` and ``[1, N]`` or
    transposed); the result has their broadcast shape.
    """
    covered = (pq < 0) | (pk < 0)  # all False, broadcast shape
    for j in range(NPRI):
        wj = tl.load(CFG + 2 * j)
        rj = tl.load(CFG + 2 * j + 1)
        tq = pq % wj
        tk = pk % wj
        cq = tq % rj
        same = ((pq - tq) == (pk - tk)) & (cq == (tk % rj))
        if PER_HEAD:
            same = same & (cq == (h % rj))
        covered = covered | same
    return covered == 0


@triton.jit
def _participates(pq, h, LCFG, NL, PER_HEAD: tl.constexpr):
    """Rows (positions ``pq``) that take part in any of the configs ``LCFG[0:NL]`` for head ``h``.

    Those are the rows an earlier launch already wrote a partial result for.
    """
    part = (pq < 0)
    for j in range(NL):
        wj = tl.load(LCFG + 2 * j)
        rj = tl.load(LCFG + 2 * j + 1)
        if PER_HEAD:
            part = part | (((pq % wj) % rj) == (h % rj))
        else:
            part = part | (pq >= 0)
    return part
