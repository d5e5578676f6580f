"""Host-side planning: position → storage maps, config order, block sizes.

Two orderings run through the same kernels: natural (queries at consecutive positions ``qoff..``
stored at ``position - qoff``, keys likewise from ``koff``: no table, strided loads), and mapped
(any per-row injective map, e.g. Hilbert order, ring shards, explicit ``position_ids``: an
``int32`` inverse table ``inv[b, pos]``, ``-1`` = absent). Unsupported (the PyTorch path runs,
``docs/kernels.md``): negative positions, a position stored twice in one row, or positions
spread over more than ``MAX_SPREAD`` × the sequence length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..inputs import _is_arange
from ..plan_cache import PlanCache, memoised
from ..planning import period, priority_configs

MAX_SPREAD = 4  # position range / sequence length above which the mapped plan is refused
W_CAP = 1 << 30  # positions are < 2**30; a longer segment behaves identically


@dataclass
class PositionPlan:
    mapped: bool
    qoff: int  # natural: query storage index = position - qoff
    qlo: int  # query positions lie in [qlo, qhi], keys in [klo, khi]
    qhi: int
    klo: int
    khi: int
    qinv: Optional[torch.Tensor]  # [Bp, P] int32, -1 = absent
    kinv: Optional[torch.Tensor]
    qdoc: Optional[torch.Tensor]  # [Bd, Sq] int32
    kdoc: Optional[torch.Tensor]
    # every position of [qlo, qhi] and [klo, khi] is present in every row (a permutation such
    # as Hilbert order): no validity masks inside the ranges
    full: bool = False
    koff: int = 0  # natural: key storage index = position - koff
    # Positions above are relative to ``base``, a multiple of every segment length (segments,
    # classes, causal order unchanged): tables cover only the positions in use.
    base: int = 0

    @property
    def size(self) -> int:
        """Positions lie in ``[0, size)``."""
        return max(self.qhi, self.khi) + 1

    @property
    def mapped_kind(self) -> int:
        """Kernel constant: 0 natural, 1 full map (a permutation), 2 partial map (gaps)."""
        return 0 if not self.mapped else (1 if self.full else 2)


def _inverse(p: torch.Tensor, size: int) -> Optional[torch.Tensor]:
    """inv[b, pos] = storage index, or None if a position repeats within a row."""
    bp, n = p.shape
    inv = torch.full((bp, size), -1, device=p.device, dtype=torch.int32)
    inv.scatter_(1, p, torch.arange(n, device=p.device, dtype=torch.int32).expand(bp, n))
    return inv if int((inv >= 0).sum()) == bp * n else None


# Plans by positions (explicit ones read on the host: device syncs), made once per positions
# (plan_cache); at most 16 (mapped ones hold position -> storage tables on the device).
_PLANS = PlanCache(8, per_key=2)


def plan_positions(a, pattern=None) -> tuple:
    """Build the :class:`PositionPlan` for checked inputs ``a`` (``inputs.AttnInputs``).

    Natural (no table) when queries and keys each sit at consecutive positions (any start, the
    same in every row); else a position -> storage table. With ``pattern``, positions are taken
    relative to the largest multiple of its period at or below the smallest one. Plans are
    reused while the tensors are unchanged (``plan_cache``): never modify one
    (``dataclasses.replace`` makes a changed copy).

    Returns:
        ``(plan, None)`` or ``(None, reason)`` when the kernels cannot take these positions.
    """
    if a.natural_positions and a.q_doc_ids is None:
        return _natural(a.sq, a.sk)
    key = ("positions", period(pattern, W_CAP), a.natural_positions, a.sq, a.sk)
    return _PLANS.get_or_make(key, (a.q_positions, a.k_positions, a.q_doc_ids, a.k_doc_ids),
                              lambda: _plan_positions(a, pattern))


@functools.lru_cache(maxsize=256)
def _natural(sq: int, sk: int) -> tuple:
    """The plan of queries at ``sk - sq .. sk - 1`` and keys at ``0 .. sk - 1`` (shared)."""
    return PositionPlan(False, sk - sq, sk - sq, sk - 1, 0, sk - 1, None, None, None, None), None


def _plan_positions(a, pattern) -> tuple:
    """:func:`plan_positions` without the memo."""
    qp, kp = a.q_positions, a.k_positions
    qdoc = None if a.q_doc_ids is None else a.q_doc_ids.to(torch.int32).contiguous()
    kdoc = None if a.k_doc_ids is None else a.k_doc_ids.to(torch.int32).contiguous()
    sq, sk = a.sq, a.sk
    if a.natural_positions:
        return PositionPlan(False, sk - sq, sk - sq, sk - 1, 0, sk - 1, None, None, qdoc, kdoc), None
    if sq == 0 or sk == 0:
        return None, "empty query or key positions"
    (qlo, qhi), (klo, khi) = ((int(p.min()), int(p.max())) for p in (qp, kp))
    if min(qlo, klo) < 0:
        return None, f"negative positions (min {min(qlo, klo)})"
    per = period(pattern, W_CAP)
    base = min(qlo, klo) // per * per if per else 0
    qlo, qhi, klo, khi = qlo - base, qhi - base, klo - base, khi - base
    full = qhi - qlo + 1 == sq and khi - klo + 1 == sk  # unique positions: they fill the ranges
    if full and _is_arange(qp, qlo + base) and _is_arange(kp, klo + base):
        return PositionPlan(False, qlo, qlo, qhi, klo, khi, None, None, qdoc, kdoc,
                            koff=klo, base=base), None
    size = max(qhi, khi) + 1
    if size > MAX_SPREAD * max(sq, sk) + 4096:
        return None, f"positions spread over {size} for {max(sq, sk)} tokens"
    kinv = _inverse(kp - base, size)
    qinv = kinv if qp is kp else _inverse(qp - base, size)
    if kinv is None or qinv is None:
        return None, "a position repeats within a row (e.g. packed documents)"
    return PositionPlan(True, 0, qlo, qhi, klo, khi, qinv, kinv, qdoc, kdoc, full,
                        base=base), None


_KEY_CACHE: dict = {}


def union_keys(prio, size: int, device) -> torch.Tensor:
    """``KEYS[j, pos] = (pos // w_j) * r_j + (pos % w_j) % r_j`` (int32) for the priority configs
    but the last: equal keys <=> same segment and class of config ``j`` (the union test).

    ``[len(prio) - 1, size]``, cached per (configs, size, device); a few MB at 1M positions.
    """
    def make():
        pos = torch.arange(size, device=device, dtype=torch.int64)
        rows = [(pos // w) * r + (pos % w) % r for w, r in prio[:-1]] or [pos * 0]
        return torch.stack(rows).to(torch.int32).contiguous()

    return memoised(_KEY_CACHE, (tuple(prio), int(size), str(device)), 9, make)


def config_order(pattern):
    """``(prio, launch)``: lists of ``(w, r)`` (``w`` capped at 2**30) in union priority
    (``planning.priority``) and in launch order, the same with the first (covering every
    query) moved last so it writes the final output in place."""
    # capped segments past every position behave alike: one of them is enough
    prio = list(dict.fromkeys((min(w, W_CAP), r) for w, r in priority_configs(pattern)))
    return prio, prio[1:] + prio[:1]


def fwd_blocks(d: int, dtype: torch.dtype, interpret: bool, table: bool = False,
               first: bool = False):
    """(BM, BN, num_warps, num_stages) of the forward kernel; ``table``: of a launch that tests
    the union rule pair by pair through the key tables (``_calls._needs_pair_mask``);
    ``first``: of the launch with no earlier config (no union code: rate 1 in longnet_lm, most
    of the pairs, and the dense pattern)."""
    if interpret:
        return 16, 16, 1, 1
    if d > 128:  # head size 256 (Gemma): 64 x 32 tiles, 4 warps: 4.3x the 32 x 32 / 8 warps
        # tiles of D58, which spilled nothing (H200, docs/decisions.md D66)
        return (16, 16, 4, 2) if dtype == torch.float32 else (64, 32, 4, 2)
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if first:
        # head size 128: 421 -> 468 TFLOP/s (dense, 64K, H100); at 64 it lost
        # (docs/decisions.md "The first launch's forward tile")
        return (128, 64, 8, 3) if d > 64 else (64, 64, 4, 3)
    if table:
        # no spills on sm_90 (64 x 64 spilled; kernel_resources.py; docs/decisions.md)
        return 64, 32, 4, 3
    # beat 128x64 / 8 warps on longnet_lm (short class runs; H200, docs/decisions.md)
    return 64, 64, 4, 3


def fwd_max_registers(tile, first: bool) -> Optional[int]:
    """Register cap (``maxnreg``) of a forward launch with tile ``(BM, BN, warps, stages)``, or
    None: the first launch at head size 64 fits 3 programs per SM at <= 168 (ptxas alone gave 182:
    2 per SM, 12 % slower on an H100; capped: 162, no spills; docs/decisions.md)."""
    return 168 if first and tuple(tile[:3]) == (64, 64, 4) else None


# Shared memory per program on GPUs with less than Ampere-datacenter / Hopper (sm_86 / sm_89:
# 99 KiB); the default dk/dv tile of head size 128 needs 129 KiB there (tools/aot.py).
SMALL_SMEM = 101376


def bwd_blocks(d: int, dtype: torch.dtype, interpret: bool, smem: Optional[int] = None,
               pair: bool = True):
    """(BM, BN, num_warps, num_stages) of the dq kernel: BM queries per program, BN keys per
    step (:func:`dkdv_blocks` starts from them, roles swapped). ``smem``: shared memory per
    program (None: an A100's or H100's). ``pair``: a launch testing the union rule per pair."""
    if interpret or d > 128:  # head size 256, as the forward's (2.7x D58's 32 x 32, 8 warps: D66)
        return fwd_blocks(d, dtype, interpret)
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if d == 64:  # 64 x 64, 4 warps, 3 stages (64 KiB): dq 10-19 % faster than 128 x 64 at
        # 4K-64K, with and without the per-pair mask (H200, docs/decisions.md D71)
        return 64, 64, 4, 3
    if smem is not None and smem <= SMALL_SMEM:  # (a third stage needs 128 KiB of shared
        return 128, 64, 8, 2                      # memory, more than an RTX 3090/4090 has)
    # a third stage (docs/decisions.md "dq stages"); with the union test pair by pair through
    # the key tables, 32 keys a step (longnet_lm's rates 6 and 12: 13-14 % faster than 128 x 64
    # with two stages at 64K-128K on an H100, D87; the tile D84 tried on every launch was slower)
    return (128, 32, 8, 3) if pair else (128, 64, 8, 3)


def dkdv_blocks(d: int, dtype: torch.dtype, interpret: bool, smem: Optional[int] = None,
                skips: bool = False):
    """(BM, BN, num_warps, num_stages) of the dk/dv kernel: BN keys per program, BM queries per
    step. With at most ``SMALL_SMEM`` of shared memory (RTX 3090/4090, L4, L40) head size 128
    in 16-bit takes a smaller key tile. ``skips``: a launch after earlier configs whose programs
    need no per-pair union mask (``_calls._may_mix`` False)."""
    bm, bn, warps, stages = bwd_blocks(d, dtype, interpret, smem)
    if interpret:
        return bm, bn, warps, stages
    if d > 128:  # head size 256: two [BN, 256] float32 sums per program, 32 queries a step,
        # 4 warps (3.1x D58's 16 queries and 8 warps: D66)
        return (16, 16, 8, 2) if dtype == torch.float32 else (32, 32, 4, 2)
    if smem is not None and smem <= SMALL_SMEM and d > 64 and dtype != torch.float32:
        return DKDV_SMALL_SMEM
    if dtype == torch.float32:
        return bn, bm, warps, stages  # the dq tile, roles swapped
    if d == 64:  # 16 queries a step against 64 keys, 4 warps, 3 stages: 4-20 % faster than
        # 32 x 128 / 8 warps at 4K-64K (more programs where key/value heads are few; D71)
        return 16, 64, 4, 3
    # 32 queries per step (64 spilled in the union variant on sm_90); a third stage only without
    # union code (115 KiB of shared memory; docs/decisions.md "Launches without mixed programs")
    stages = 3 if skips and (smem is None or smem > SMALL_SMEM) else 2
    return 32, 128, 8, stages


# dk/dv tile where shared memory is small: 68.5 KiB of sm_86's 99 KiB (D 128, bf16). Not timed.
DKDV_SMALL_SMEM = (32, 64, 4, 2)
