"""How the forward's partial results meet: slots.

The configs of a call run in two launches. The first holds every union config's programs
(configs over runs of heads, rows of one launch table): each writes its partial result ``(out,
lse)`` into its config's slot, float32 rows of one class of one head packed, and no program
reads another's. The second launch holds the covering config's programs (the config that
covers every query; the dense heads' rows too): each merges the slots' partial results of its
rows into its own, in the table's order, and writes the result (docs/kernels.md, "Two
launches, partial results meeting in slots").
"""

import triton
import triton.language as tl

from ._common import LAUNCH_ROW

# Roles of a forward row (``ROLE``): a union config's partial result (into its slot), the
# covering config (merges the slots' partial results of its rows and writes the result), or a
# row alone (dense heads: writes its result).
UNION, COVER, ALONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
UCFG_ROW = 8  # int32 per union config in the covering rows' table: W, R, QLO, QHI, SLOT
_ROW = tl.constexpr(LAUNCH_ROW)
_UROW = tl.constexpr(UCFG_ROW)


@triton.jit
def _grouped_program(L, NL):
    """A forward program's row and tile: ``(L of its row, tile, b * heads + head in the
    row)``, from its program id and the rows' first programs (``PSTART``)."""
    t = tl.program_id(0)
    j = 0
    for i in range(1, NL):
        j = tl.where(tl.load(L + i * _ROW + 24) <= t, i, j)
    row = L + j * _ROW
    local = t - tl.load(row + 24)
    ntile = tl.load(row + 25)
    return row, local % ntile, local // ntile


@triton.jit
def _slot_row(p, W, R, PER_HEAD: tl.constexpr):
    """The row of position ``p`` in the slot of a union config ``(W, R)``: per_head, a head's
    rows are one class, packed segment by segment; with every class, ``p`` itself."""
    row = p
    if PER_HEAD:
        seg = p // W
        row = seg * ((W + R - 1) // R) + (p - seg * W) // R
    return row


@triton.jit
def _in_union(pq, ok, hc, U, PER_HEAD: tl.constexpr):
    """The rows (positions ``pq`` where ``ok``) for which the union config at ``U`` (its
    table row: ``W, R, QLO, QHI, SLOT``) wrote a partial result, for head ``hc``."""
    w = tl.load(U)
    r = tl.load(U + 1)
    part = ok & (pq >= tl.load(U + 2)) & (pq <= tl.load(U + 3))
    if PER_HEAD:
        part = part & (((pq % w) % r) == (hc % r))
    return part


@triton.jit
def _merge2(out_a, lse_a, out_b, lse_b):
    """``(out, lse)`` over the keys of two partial results (lse in base 2; an empty one is
    ``(0, -inf)``, and two empty ones stay so)."""
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == float("-inf"), 0.0, top)
    wa = tl.math.exp2(lse_a - top)
    wb = tl.math.exp2(lse_b - top)
    tot = wa + wb
    lse = tl.where(tot > 0, top + tl.math.log2(tl.where(tot > 0, tot, 1.0)), float("-inf"))
    inv = 1.0 / tl.where(tot > 0, tot, 1.0)
    return out_a * (wa * inv)[:, None] + out_b * (wb * inv)[:, None], lse


@triton.jit
def _slot_rows(slots, b64, hh, srow):
    """Pointers to slot rows ``srow`` (int64) of head ``hh``: a row holds a partial result's
    ``D`` columns, then its lse."""
    return slots.ptr + b64 * slots.sb + hh.to(tl.int64) * slots.sh + srow * slots.ss


@triton.jit
def _leave(out, lse2, pq, ok, slots, b64, hh, SLOT, W, R, PER_HEAD: tl.constexpr,
           D: tl.constexpr):
    """A union program's partial result ``(out, lse2)`` into its config's slot."""
    rows = _slot_rows(slots, b64, hh, (SLOT + _slot_row(pq, W, R, PER_HEAD=PER_HEAD)).to(tl.int64))
    tl.store(rows[:, None] + tl.arange(0, D)[None, :], out, mask=ok[:, None])
    tl.store(rows + D, lse2, mask=ok)


@triton.jit
def _meet(out, lse2, pq, ok, hc, slots, b64, hh, UCFG, NU, PER_HEAD: tl.constexpr,
          D: tl.constexpr):
    """A covering program's result ``(out, lse2)`` merged with the partial results the ``NU``
    union configs (``UCFG``) wrote for its rows, in the table's order."""
    for u in range(NU):
        U = UCFG + u * _UROW
        part = _in_union(pq, ok, hc, U, PER_HEAD=PER_HEAD)
        srow = tl.load(U + 4) + _slot_row(pq, tl.load(U), tl.load(U + 1), PER_HEAD=PER_HEAD)
        rows = _slot_rows(slots, b64, hh, tl.where(part, srow, 0).to(tl.int64))
        u_out = tl.load(rows[:, None] + tl.arange(0, D)[None, :], mask=part[:, None], other=0.0)
        u_lse = tl.load(rows + D, mask=part, other=float("-inf"))
        out, lse2 = _merge2(out, lse2, u_out, u_lse)
    return out, lse2
