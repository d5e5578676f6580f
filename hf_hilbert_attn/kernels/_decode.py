"""Decode kernel: a few queries against a long key/value cache, split over keys
(flash-decoding), the pattern given as a mask planned once per forward.

The queries of the ``G = Hq // Hkv`` query heads that read one key/value head are the rows of
one tile (``G * Sq`` rows, zero-padded to ``BR >= 16`` for ``tl.dot``), so each key is read
once per key/value head. ``bias`` ``[Bm, Hkv, G * Sq, >= Sk]`` holds 0 for an allowed pair and
``-inf`` for any other (the pattern, causality, documents, padding and dense heads, decided by
the plan); a key tile no row may attend is not loaded at all, so a sparse pattern reads only
the tiles it needs. Program ``(b * Hkv + j, split)`` writes the float32 partial result of its
keys; :func:`_decode_merge_kernel` merges the splits by log-sum-exp into ``out`` and ``lse``.
"""

import torch
import triton
import triton.language as tl

from ._common import LN2, Strided
from ._launch import launch

__all__ = ["decode_fwd", "DECODE_MAX_ROWS"]

DECODE_MAX_ROWS = 128  # G * Sq rows of one tile
_SMS: dict = {}


@triton.jit(do_not_specialize=["SK", "KPER", "NSPLIT"])
def _decode_split_kernel(q_t, k_t, v_t, bias_t, OP, LP, HKV, GROUP, SQ, ROWS, SK, KPER, NSPLIT,
                         scale_log2, BR: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                         IEEE: tl.constexpr):
    # q_t, k_t, v_t: ``Strided`` [B, H, S, D]; bias_t: ``Strided`` [Bm, Hkv, rows, >= Sk]
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    j = bh % HKV
    r = tl.arange(0, BR)
    rok = r < ROWS
    h = j * GROUP + r // SQ  # row r: query head j*G + r // Sq, query r % Sq
    d = tl.arange(0, D)
    q = tl.load(q_t.ptr + b * q_t.sb + h[:, None].to(tl.int64) * q_t.sh
                + (r % SQ)[:, None] * q_t.ss + d[None, :], mask=rok[:, None], other=0.0)
    kb = k_t.ptr + b * k_t.sb + j.to(tl.int64) * k_t.sh
    vb = v_t.ptr + b * v_t.sb + j.to(tl.int64) * v_t.sh
    bb = bias_t.ptr + b * bias_t.sb + j.to(tl.int64) * bias_t.sh + r[:, None].to(tl.int64) * bias_t.ss
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    lo = sp * KPER
    hi = tl.minimum(lo + KPER, SK)
    for n0 in range(lo, hi, BN):
        n = n0 + tl.arange(0, BN)
        nok = n < hi
        bias = tl.load(bb + n[None, :], mask=rok[:, None] & nok[None, :], other=float("-inf"))
        if tl.max(tl.max(bias, 1), 0) > float("-inf"):  # some row attends a key of this tile
            k = tl.load(kb + n[:, None].to(tl.int64) * k_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2 + bias
            m_new = tl.maximum(m, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            p = tl.math.exp2(s - m_ref[:, None])
            alpha = tl.math.exp2(m - m_ref)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(vb + n[:, None].to(tl.int64) * v_t.ss + d[None, :], mask=nok[:, None],
                        other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
    some = l > 0
    lse2 = tl.where(some, m + tl.math.log2(tl.where(some, l, 1.0)), float("-inf"))
    o = acc / tl.where(some, l, 1.0)[:, None]
    row = (bh.to(tl.int64) * NSPLIT + sp) * ROWS + r
    tl.store(LP + row, lse2, mask=rok)
    tl.store(OP + row[:, None] * D + d[None, :], o, mask=rok[:, None])


@triton.jit(do_not_specialize=["NSPLIT"])
def _decode_merge_kernel(OP, LP, o_t, lse_t, HKV, GROUP, SQ, ROWS, NSPLIT,
                         BR: tl.constexpr, D: tl.constexpr):
    # o_t: ``Strided`` [B, Hq, Sq, D]; lse_t: ``Strided`` [B, Hq, Sq] (ss: 1)
    bh = tl.program_id(0)
    b = (bh // HKV).to(tl.int64)
    j = bh % HKV
    r = tl.arange(0, BR)
    rok = r < ROWS
    d = tl.arange(0, D)
    base = bh.to(tl.int64) * NSPLIT * ROWS
    m = tl.full([BR], float("-inf"), tl.float32)
    for s in range(0, NSPLIT):
        m = tl.maximum(m, tl.load(LP + base + s * ROWS + r, mask=rok, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, D], tl.float32)
    for s in range(0, NSPLIT):
        row = base + s * ROWS + r
        w = tl.math.exp2(tl.load(LP + row, mask=rok, other=float("-inf")) - m_ref)
        tot += w
        acc += w[:, None] * tl.load(OP + row[:, None] * D + d[None, :], mask=rok[:, None],
                                    other=0.0)
    some = tot > 0
    o = acc / tl.where(some, tot, 1.0)[:, None]
    lse = tl.where(some, (m_ref + tl.math.log2(tl.where(some, tot, 1.0))) * LN2, float("-inf"))
    h = (j * GROUP + r // SQ).to(tl.int64)
    i = r % SQ
    tl.store(o_t.ptr + b * o_t.sb + h[:, None] * o_t.sh + i[:, None] * o_t.ss + d[None, :],
             o.to(o_t.ptr.dtype.element_ty), mask=rok[:, None])
    tl.store(lse_t.ptr + b * lse_t.sb + h * lse_t.sh + i * lse_t.ss, lse, mask=rok)


def _sms(device) -> int:
    """Streaming multiprocessors of ``device`` (a split count target); 8 off CUDA."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def _cdiv(a: int, b: int) -> int:  # (triton.cdiv is a slow call from Python in some releases)
    return -(-a // b)


def _splits(batch_heads: int, sk: int, bn: int, device) -> tuple:
    """(keys per split, splits): enough programs to fill the GPU twice, whole tiles each."""
    tiles = _cdiv(sk, bn)
    want = max(1, min(tiles, _cdiv(2 * _sms(device), batch_heads)))
    per = _cdiv(tiles, want) * bn
    return per, _cdiv(sk, per)


def _guard(tensors: tuple, ints: tuple) -> tuple:
    """What Triton specialises a launch on: each tensor's (``Strided``'s) dtype, 16-byte
    alignment and strides, each integer's value (``_launch.launch``'s guard, without its walk)."""
    return (tuple((t.ptr.dtype, t.ptr.data_ptr() % 16 == 0, t.sb, t.sh, t.ss)
                  if isinstance(t, Strided) else (t.dtype, t.data_ptr() % 16 == 0)
                  for t in tensors), ints)


def decode_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
               scale: float, out: torch.Tensor = None, interpret: bool = False):
    """``(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32, natural log)``: attention of
    ``q`` over ``k``/``v`` ``[B, Hkv, Sk, D]`` where ``bias`` ``[Bm, Hkv, (Hq // Hkv) * Sq, >=
    Sk]`` (float32 0 / -inf, ``Bm`` 1 or B, unit last stride) is 0; a query with no such key
    gets 0 and -inf. Two launches: the splits over keys, then their merge."""
    B, HQ, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    group = HQ // HKV
    rows = group * SQ
    dev = q.device
    if out is None:
        out = torch.empty_like(q)
    br = max(16, 1 << (rows - 1).bit_length())
    bn = 16 if interpret else 64
    per, nsplit = _splits(B * HKV, max(SK, 1), bn, dev)
    # one float32 workspace: the splits' outputs [B*Hkv*splits*rows, D], their lse, the result's
    n = B * HKV * nsplit * rows
    work = torch.empty(n * (D + 1) + B * HQ * SQ, device=dev, dtype=torch.float32)
    part_o, part_l = work[:n * D].view(n, D), work[n * D:n * (D + 1)]
    lse = work[n * (D + 1):].view(B, HQ, SQ)
    qs, ks, vs, os_ = (Strided(t, *t.stride()[:3]) for t in (q, k, v, out))
    bs = Strided(bias, bias.stride(0) if bias.shape[0] > 1 else 0, *bias.stride()[1:3])
    ls = Strided(lse, lse.stride(0), lse.stride(1), 1)
    scale_log2 = float(scale) / LN2.value
    # the key count (every step) and the split it sets are not specialised on: the guard of the
    # launch cache leaves them out, so a decode step reuses the compiled launch
    ints = (HKV, group, SQ, rows)
    head = (qs, ks, vs, bs, part_o, part_l)
    launch(_decode_split_kernel, (B * HKV, nsplit), head + ints + (SK, per, nsplit, scale_log2),
           dict(BR=br, BN=bn, D=D, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2),
           _guard(head, ints))
    head = (part_o, part_l, os_, ls)
    launch(_decode_merge_kernel, (B * HKV,), head + ints + (nsplit,),
           dict(BR=br, D=D, num_warps=4), _guard(head, ints))
    return out, lse
