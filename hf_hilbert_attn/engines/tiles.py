"""The dense-tile engine: PyTorch's fused CPU attention (the kernel SDPA runs on CPU) over dense
tiles in class coordinates, for causal self-attention at positions 0..S-1 (a prefill or training
step; packed documents and padding: one call per document, ``plan_documents``).

Planned once per (pattern, length, heads) as batched calls of that kernel, each over tiles in
the *class coordinates* of a config: the tokens ``c, c + r, c + 2r, ...`` of one segment (or of
the sequence, sliding windows). A unit is a (query head, class) pair: per_head, head h and class
h % r; in "all" mode every head with every class; a rate-1 config keeps all heads in one tile
(grouped-query layout, no per-head copies of K/V).

- segment config with no earlier config: one causal square per (unit, segment);
- segment config whose earlier configs cover whole blocks (rates divide r_i, segments divide
  w_i and are multiples of r_i): a block staircase, query block b against the keys of blocks
  < b, as unmasked rectangles;
- any other segment config: query blocks of FAST_QUERY_BLOCK against the keys up to the block,
  with a boolean mask (causality and the union rule, ``DilatedPattern.config_allowed``);
- sliding config whose earlier configs all have rates dividing r_i: within a class the pairs
  are the band ``a <= t_p - t_s < b`` (a = ceil(cov / r), b = ceil(w_i / r), cov the largest
  earlier window), cut into blocks of width b - a: each against itself (causal) and against the
  block before it, which, both orders reversed, is causal too;
- sink tokens: every query against keys 0..k-1 with the union mask, in plain matmuls.

Padded tiles read any valid row (a padded key is masked; a padded query writes a dummy row S,
lse = +inf backward). Tiles merge (out, lse); the backward runs per tile with the merged (out,
lse), dlse folded in as one extra feature column (dout 1, out -dlse). Anything else takes the
blockwise engine. Measured against SDPA: docs/decisions.md D26.
"""

from __future__ import annotations

import functools

import torch

from ..numerics import accum_dtype, finite_or_zero, merge_into
from ..planning import class_uniform, covered_window, covers, nests, priority
from .documents import document_runs

_FLASH_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                     None)
FAST_QUERY_BLOCK = 512  # masked tiles: queries per tile


class _Tiles:
    """One fused-kernel call over ``n`` problems of ``lq`` queries and ``lk`` keys, each with
    every head (grouped, rows in (problem, head, token) order) or with one. ``qr`` indexes
    the rows of q ``[Hq * S]``, ``kr`` of k ``[Hkv * S]``, ``qw`` of the output ``[Hq * (S +
    1)]`` (row S of a head: a padded query's dummy); ``q_range`` / ``k_range``: the positions
    ``(lo, hi)`` of a grouped tile over one range (views). ``mask`` ``[n, lq, lk]`` bool or
    None; ``empty`` ``[n * lq]`` rows without an allowed key, or None; ``first``: no earlier
    tile wrote these rows (``mixed``: some)."""

    __slots__ = ("n", "lq", "lk", "qr", "kr", "qw", "causal", "mask", "empty", "first", "mixed",
                 "q_range", "k_range")


class _FastPlan:
    """The tiles in order, the sink keys' mask ``[Hq, S - sink_lo, k]`` for the queries from
    ``sink_lo`` on (the earlier ones get no sink pair; None: none does) and whether the
    accumulators need initialising (some tile merges into rows not all written yet)."""

    __slots__ = ("tiles", "sink_mask", "sink_lo", "init")


def _tiles(s, hq, hkv, qh, qt, kt, causal, touched, mask=None):
    """``_Tiles`` of problems with query heads ``qh`` ``[N]`` (None: all heads), query rows
    ``qt`` ``[N, Lq]`` and key rows ``kt`` ``[N, Lk]`` (``s`` marks padding); problems with no
    query (masked: no allowed pair) are dropped. ``touched`` ``[Hq, S + 1]`` records the rows
    written so far. None when nothing is left."""
    keep = (qt < s).any(1) if mask is None else mask.flatten(1).any(1)
    if not bool(keep.all()):
        qt, kt, qh, mask = (None if x is None else x[keep] for x in (qt, kt, qh, mask))
    if qt.shape[0] == 0 or qt.shape[1] == 0 or kt.shape[1] == 0:
        return None
    t = _Tiles()
    t.n, t.lq, t.lk, t.causal, t.mask = qt.shape[0], qt.shape[1], kt.shape[1], causal, mask
    t.q_range = t.k_range = None
    if qh is None:  # rows ordered (problem, head, token): a gather is the kernel's layout
        t.q_range, t.k_range = _as_range(qt.flatten(), s), _as_range(kt.flatten(), s)
        qh, kh = torch.arange(hq).view(1, -1, 1), torch.arange(hkv).view(1, -1, 1)
        qt, kt = qt[:, None], kt[:, None]  # [N, 1, L], against every head [1, H, 1]
    else:
        qh, kh = qh[:, None], qh[:, None] // (hq // hkv)
    t.qr = (qh * s + qt.clamp_max(s - 1)).flatten()
    t.kr = (kh * s + kt.clamp_max(s - 1)).flatten()
    qw = qh * (s + 1) + qt
    t.qw, flat = qw.flatten(), touched.view(-1)
    seen = flat[qw[(qt < s).expand_as(qw)]]
    flat[t.qw] = True
    # first: no row written before (the kernel's result is copied in); otherwise the rows are
    # merged, and where only some were written the plan initialises the accumulators
    t.first = not bool(seen.any())
    t.mixed = not (t.first or bool(seen.all()))
    empty = None if mask is None else ~mask.any(-1).flatten()
    t.empty = empty if empty is not None and bool(empty.any()) else None
    return t


def _as_range(rows, s):
    """``(lo, hi)`` when ``rows`` is ``lo, lo + 1, ..., hi - 1`` with ``hi <= s``, else None."""
    lo, hi = int(rows[0]), int(rows[0]) + rows.numel()
    return (lo, hi) if hi <= s and torch.equal(rows, torch.arange(lo, hi)) else None


def _units(pattern, i, hq):
    """(query head, class) pairs of config ``i``: two ``[U]`` tensors."""
    r = pattern.dilation_rates[i]
    h = torch.arange(hq)
    return (h, h % r) if pattern.query_dilation == "per_head" or r == 1 else \
        (h.repeat_interleave(r), torch.arange(r).repeat(hq))


def _segment_tiles(pattern, i, earlier, s, hq, hkv, touched):
    """Tiles of segment config ``i`` after the configs ``earlier`` (indices; see the comment
    above)."""
    w, r = pattern.configs[i]
    idx, earlier = earlier, [pattern.configs[j] for j in earlier]
    if any(covers(cfg, (w, r), False) for cfg in earlier):
        # an earlier config covers every pair of every segment: its segments hold ours, and
        # our classes lie inside its classes (w % rj: a segment of ours starts on one of its
        # class boundaries; (43, 2) after (86, 2) does not: 43 starts on the odd class)
        return []
    # each earlier config owns exactly the pairs of our class inside one of its segments
    big = max((wj for wj, _ in earlier), default=0)
    nested = all(class_uniform(cfg, r, False) and nests(cfg[0], w, r) and big % cfg[0] == 0
                 for cfg in earlier)
    grouped = r == 1 and (nested or not earlier)
    uh, uc = _units(pattern, i, 1 if grouped else hq)  # grouped: one unit, every head in a tile
    out = []
    full, rest = divmod(s, w)
    sets = [(torch.arange(full) * w, w)] if full else []
    if rest:
        sets.append((torch.tensor([full * w]), rest))
    for starts, seg_len in sets:
        length = -(-seg_len // r)  # tokens of class 0, the longest class
        c, start = uc.view(-1, 1, 1), starts.view(1, -1, 1)
        h = None if grouped else uh.view(-1, 1).expand(-1, starts.numel()).flatten()

        def rows(t):  # class indices [L] -> storage rows [U * G, L] (s: none)
            off = c + r * t.view(1, 1, -1)
            return torch.where(off < seg_len, start + off, s).flatten(0, 1)

        def add(qt, kt, causal, mask=None):
            out.append(_tiles(s, hq, hkv, h, qt, kt, causal, touched, mask))

        if not earlier:
            t = torch.arange(length)
            add(rows(t), rows(t), True)
        elif nested:
            m = big // r
            for b in range(1, -(-length // m)):
                tq = b * m + torch.arange(min(m, length - b * m))
                add(rows(tq), rows(torch.arange(b * m)), False)
        else:
            hb = uh.view(-1, 1, 1, 1)
            for lo in range(0, length, FAST_QUERY_BLOCK):
                hi = min(lo + FAST_QUERY_BLOCK, length)
                qt, kt = rows(torch.arange(lo, hi)), rows(torch.arange(hi))
                qp, kp = qt.view(uh.numel(), -1, hi - lo, 1), kt.view(uh.numel(), -1, 1, hi)
                mask = (kp <= qp) & (qp < s)
                for j in idx:
                    mask &= ~pattern.config_allowed(j, hb, qp, kp)
                add(qt, kt, False, mask.flatten(0, 1))
    return out


def _sliding_tiles(pattern, i, earlier, s, hq, hkv, touched):
    """Tiles of sliding config ``i`` after the configs ``earlier`` (indices, each class-uniform:
    ``_fast_applies``; see the comment above)."""
    w, r = pattern.configs[i]
    cov = covered_window([pattern.configs[j] for j in earlier], r)
    a, b = -(-cov // r), -(-w // r)
    uh, uc = _units(pattern, i, 1 if r == 1 else hq)  # rate 1: one unit, every head in a tile
    n = torch.div(s - uc + (r - 1), r, rounding_mode="floor")  # tokens per class
    m_max = int((n - a).max())
    if b <= a or m_max <= 0:
        return []
    blk = min(b - a, m_max)
    nb = -(-m_max // blk)
    c, nc = uc.view(-1, 1, 1), n.view(-1, 1, 1)

    def rows(t):  # class indices [U, nb', L] -> storage rows [U * nb', L] (s: none)
        return torch.where((t >= 0) & (t < nc), c + r * t, s).flatten(0, 1)

    def tile(tq, tk):  # a causal tile of the class indices tq, tk [1, nb', L]
        tq = tq.expand(uh.numel(), -1, -1)
        h = None if r == 1 else uh.view(-1, 1).expand(-1, tq.shape[1]).flatten()
        return _tiles(s, hq, hkv, h, rows(tq), rows(tk.expand_as(tq)), True, touched)

    base = torch.arange(nb).view(1, -1, 1) * blk
    x = torch.arange(blk).view(1, 1, -1)
    out = [tile(a + base + x, base + x)]
    if nb > 1 and blk > 1:  # the block before, both orders reversed: causal again
        x, base = x[..., :-1], base[:, 1:]
        out.append(tile(a + base + blk - 2 - x, base - 1 - x))
    return out


def _fast_applies(pattern, a, causal, q) -> bool:
    """Whether the dense-tile path can take this call, positions and documents aside (PyTorch's
    fused attention, which it calls, has no soft-capping)."""
    cfgs = [pattern.configs[i] for i in priority(pattern)]
    return (_FLASH_FWD is not None and _FLASH_BWD is not None and q.device.type == "cpu"
            and causal and not a.softcap and a.sq == a.sk and a.head_dim_v == a.head_dim
            # sliding: an earlier class test that varied inside a class would need masks per pair
            and not (pattern.sliding and not all(class_uniform(e, r, True) for n, (_, r)
                                                 in enumerate(cfgs) for e in cfgs[:n])))


def plan_whole(pattern, a, causal, q):
    """The dense-tile plan for this call, or None when the fast path does not apply."""
    if not _fast_applies(pattern, a, causal, q) or a.q_doc_ids is not None or not (
            a.natural_positions or all(torch.equal(p.cpu(), torch.arange(a.sq).expand_as(p))
                                       for p in (a.q_positions, a.k_positions))):
        return None
    return _natural_plan(pattern, a.sq, a.hq, a.hkv, FAST_QUERY_BLOCK)


@functools.lru_cache(maxsize=64)
def _natural_plan(pattern, s, hq, hkv, block):
    """The dense-tile plan of causal self-attention at positions 0..s-1 (cached; ``block``: the
    FAST_QUERY_BLOCK that _segment_tiles reads, part of the key)."""
    touched = torch.zeros(hq, s + 1, dtype=torch.bool)
    make = _sliding_tiles if pattern.sliding else _segment_tiles
    plan = _FastPlan()
    order = priority(pattern)
    plan.tiles = [t for n, i in enumerate(order)
                  for t in make(pattern, i, order[:n], s, hq, hkv, touched) if t is not None]
    plan.init = any(t.mixed for t in plan.tiles)
    plan.sink_mask, plan.sink_lo = None, s
    if pattern.sink_tokens:
        h, qp = torch.arange(hq).view(-1, 1, 1), torch.arange(s).view(1, -1, 1)
        kp = torch.arange(min(pattern.sink_tokens, s)).view(1, 1, -1)
        mask = (kp <= qp).expand(hq, -1, -1).clone()
        for j in range(pattern.num_configs):
            mask &= ~pattern.config_allowed(j, h, qp, kp)
        rows = mask.any(2).any(0).nonzero()
        plan.sink_lo = int(rows[0]) if rows.numel() else s
        plan.sink_mask = mask[:, plan.sink_lo:].contiguous() if rows.numel() else None
    return plan


def _float_mask(t, b, dtype):
    if t.mask is None:
        return None
    m = torch.zeros(t.mask.shape, dtype=dtype).masked_fill_(~t.mask, float("-inf"))[:, None]
    return m if b == 1 else m.repeat(b, 1, 1, 1)  # [B * n, 1, lq, lk]


def _gather(t, x, xf, b, rows, length, rng=None):
    """The tile's rows of ``x`` ``[B, H, S, D]`` (``xf``: ``[B, H * S, D]``; ``rows`` index
    it) as the kernel's ``[B * n, H or 1, length, D]``; a grouped tile over the range ``rng``
    of positions is a view (a copy only for B > 1 with several segments)."""
    if rng is not None:
        h, d = x.shape[1], x.shape[-1]
        return x[:, :, rng[0]:rng[1]].view(b, h, t.n, length, d).transpose(1, 2).reshape(
            b * t.n, h, length, d)
    return xf.index_select(1, rows).view(b * t.n, -1, length, xf.shape[-1])


def _write(t, out, lse, o, l, b):
    """Merge the kernel's ``o`` ``[B * n, H or 1, lq, D]`` and ``l`` ``[B * n, H or 1, lq]``
    into ``out`` ``[B, Hq, S + 1, D]`` / ``lse`` ``[B, Hq, S + 1]`` at the tile's rows."""
    if t.q_range is not None:  # in place on views
        o = o.view(b, t.n, -1, t.lq, o.shape[-1]).transpose(1, 2)  # [B, H, n, lq, D]
        l = l.view(b, t.n, -1, t.lq).transpose(1, 2)
        lo, hi = t.q_range
        o_t, l_t = out[:, :, lo:hi].view(o.shape), lse[:, :, lo:hi].view(l.shape)
        if t.first:
            o_t.copy_(o)
            l_t.copy_(l)
        else:
            merge_into(o_t, l_t, o, l)
        return
    o_all, l_all = out.view(b, -1, out.shape[-1]), lse.view(b, -1)
    o, l = o.reshape(b, -1, o.shape[-1]), l.reshape(b, -1)
    if not t.first:
        o_t, l_t = o_all.index_select(1, t.qw), l_all.index_select(1, t.qw)
        merge_into(o_t, l_t, o, l)
        o, l = o_t, l_t
    o_all.index_copy_(1, t.qw, o)
    l_all.index_copy_(1, t.qw, l)


def _sink_scores(plan, q, k, v, scale, acc):
    """Scaled scores of the queries from ``plan.sink_lo`` on against the sink keys, forbidden
    pairs at -inf: ``[B, Hq, S - sink_lo, k]`` in ``acc``, and the sink keys and values
    ``[B, Hq, k, D]``."""
    g, n = q.shape[1] // k.shape[1], plan.sink_mask.shape[-1]
    ks, vs = (x[:, :, :n].to(acc).repeat_interleave(g, 1) for x in (k, v))
    sc = torch.matmul(q[:, :, plan.sink_lo:].to(acc), ks.transpose(-1, -2)) * scale
    return sc.masked_fill(~plan.sink_mask, float("-inf")), ks, vs


def _fast_forward(plan, q, k, v, scale):
    """``(out, lse)`` ``[B, Hq, S, D]`` / ``[B, Hq, S]`` in the accumulation dtype."""
    b, hq, s, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    acc = accum_dtype(q.dtype)
    t = plan.tiles[0] if len(plan.tiles) == 1 else None
    if t is not None and t.n == 1 and t.q_range == t.k_range == (0, s):  # (ranges: grouped only)
        # one causal call over the whole sequence (dense up to the first window): as SDPA
        out, lse = (x.to(acc) for x in _FLASH_FWD(q, k, v, 0.0, True, scale=scale))
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qf, kf, vf = q.view(b, hq * s, d), k.view(b, hkv * s, d), v.view(b, hkv * s, dv)
        # zeros unless every row is first written whole by one tile (lse -inf either way)
        out = (q.new_zeros if plan.init else q.new_empty)(b, hq, s + 1, dv, dtype=acc)
        lse = q.new_full((b, hq, s + 1), float("-inf"), dtype=acc)
        for t in plan.tiles:
            o, l = _FLASH_FWD(_gather(t, q, qf, b, t.qr, t.lq, t.q_range),
                              _gather(t, k, kf, b, t.kr, t.lk, t.k_range),
                              _gather(t, v, vf, b, t.kr, t.lk, t.k_range), 0.0, t.causal,
                              attn_mask=_float_mask(t, b, q.dtype), scale=scale)
            if t.empty is not None:  # the kernel gives lse 0 to a row with no key
                l = l.reshape(b, -1).masked_fill(t.empty, float("-inf"))
            _write(t, out, lse, o.to(acc), l.to(acc), b)
        out, lse = out[:, :, :s], lse[:, :, :s]
    if plan.sink_mask is not None:
        # the sink keys' part (every query against keys 0..k-1, the union rule's mask), merged
        # into (out, lse) in place
        lo = plan.sink_lo
        sc, _, vs = _sink_scores(plan, q, k, v, scale, acc)
        ls = torch.logsumexp(sc, -1)
        p = torch.exp(sc - finite_or_zero(ls)[..., None])
        merge_into(out[:, :, lo:], lse[:, :, lo:], torch.matmul(p, vs), ls)
    return out, lse


def _add(t, acc, g, b, rows, length, rng):
    """``acc`` ``[B, H, R, D]`` += the kernel's gradient ``g`` ``[B * n, H or 1, length, D]``
    at the tile's rows (``rows`` index ``[H * R]``; ``rng``: a range of positions)."""
    if rng is not None:
        g = g.view(b, t.n, -1, length, g.shape[-1]).transpose(1, 2)  # [B, H, n, length, D]
        acc[:, :, rng[0]:rng[1]].view(g.shape).add_(g)
    else:
        acc.view(b, -1, acc.shape[-1]).index_add_(1, rows, g.reshape(b, -1, g.shape[-1]))


def _fast_backward(plan, q, k, v, out, lse, dout, dlse, scale):
    """(dq, dk, dv) of the dense-tile plan, in the accumulation dtype."""
    b, hq, s, d = q.shape
    hkv, dv_ = k.shape[1], v.shape[-1]
    acc = accum_dtype(q.dtype)
    lse_acc = finite_or_zero(lse.to(acc))  # a row with no key: p = 0 anyway
    t = plan.tiles[0] if len(plan.tiles) == 1 else None
    whole = t is not None and t.n == 1 and t.q_range == t.k_range == (0, s) and dlse is None
    if whole:  # one causal call over the whole sequence, as SDPA (the sinks added below)
        dq, dk, dv = _FLASH_BWD(dout, q, k, v, out, lse_acc, 0.0, True, scale=scale)
    else:
        dq = q.new_zeros(b, hq, s + 1, d, dtype=acc)
        dk, dv = (x.new_zeros(x.shape, dtype=acc) for x in (k, v))
    if plan.sink_mask is not None:  # FlashAttention's formulas on the few sink keys
        lo = plan.sink_lo  # the queries from lo on
        sc, ks, vs = _sink_scores(plan, q, k, v, scale, acc)
        p = torch.exp(sc - lse_acc[:, :, lo:, None])
        n_s, g = sc.shape[-1], hq // hkv
        do = dout[:, :, lo:].to(acc)
        delta = (do * out[:, :, lo:].to(acc)).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, :, lo:].to(acc)[..., None]
        ds = p * (torch.matmul(do, vs.transpose(-1, -2)) - delta)
        dq[:, :, lo:s] += torch.matmul(ds, ks) * scale
        fold = (b, hkv, g, n_s, -1)
        dk[:, :, :n_s] += (torch.matmul(ds.transpose(-1, -2), q[:, :, lo:].to(acc)) * scale
                           ).view(fold).sum(2)
        dv[:, :, :n_s] += torch.matmul(p.transpose(-1, -2), do).view(fold).sum(2)
    if whole:
        return dq, dk, dv
    if dlse is not None:  # the extra column: delta = rowsum(dout * out) - dlse
        q, k, v = (torch.nn.functional.pad(x, (0, 1)) for x in (q, k, v))
        dout = torch.nn.functional.pad(dout, (0, 1), value=1.0)
        out = torch.cat([out, (-dlse).to(out.dtype)[..., None]], -1)
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    # row S: lse +inf, so a padded query takes no part (p = 0)
    lr = torch.nn.functional.pad(lse_acc, (0, 1), value=float("inf")).unsqueeze(-1)
    qf, kf, vf, dof, of, lrf = (x.view(b, -1, x.shape[-1]) for x in (q, k, v, dout, out, lr))
    for t in plan.tiles:
        qr, qs, ks = (t.qr, t.lq, t.q_range), (t.qw, t.lq, t.q_range), (t.kr, t.lk, t.k_range)
        gq, gk, gv = _FLASH_BWD(
            _gather(t, dout, dof, b, *qr), _gather(t, q, qf, b, *qr), _gather(t, k, kf, b, *ks),
            _gather(t, v, vf, b, *ks), _gather(t, out, of, b, *qr),
            _gather(t, lr, lrf, b, *qs).squeeze(-1), 0.0, t.causal,
            attn_mask=_float_mask(t, b, q.dtype), scale=scale)
        for into, g, n, rows in ((dq, gq, d, qs), (dk, gk, d, ks), (dv, gv, dv_, ks)):
            _add(t, into, g[..., :n].to(acc), b, *rows)
    return dq[:, :, :s], dk, dv


class _FastAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        # float16/bfloat16 run in float32, as in the blockwise path: lse stays float32-exact
        ctx.set_materialize_grads(False)
        cdt = accum_dtype(q.dtype)
        out, lse = _fast_forward(plan, q.to(cdt), k.to(cdt), v.to(cdt), scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None
        with torch.autocast("cpu", enabled=False):
            cdt = out.dtype
            dout = torch.zeros_like(out) if dout is None else dout.to(cdt)
            dq, dk, dv = _fast_backward(ctx.plan, q.to(cdt), k.to(cdt), v.to(cdt), out, lse,
                                        dout, dlse, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def plan_documents(pattern, a, causal, q):
    """Packed or padded self-attention as ``[(row, lo, hi)]``: storage ranges each holding one
    whole document at positions 0..hi-lo-1 (``documents.document_runs``), each a call of the
    dense-tile path; None for any other layout (or no document)."""
    if a.q_doc_ids is None or not _fast_applies(pattern, a, causal, q):
        return None
    return [(b, lo, hi) for b, lo, hi, _ in document_runs(a, restart=True) or ()] or None


def attend_documents(q, k, v, pattern, a, runs):
    """``(out, lse)`` of the document ``runs``, one dense-tile call each, written into their
    ranges of the sequence (zeros and -inf between them)."""
    out = q.new_zeros(a.batch, a.hq, a.sq, v.shape[-1])
    lse = q.new_full((a.batch, a.hq, a.sq), float("-inf"), dtype=accum_dtype(q.dtype))
    for b, lo, hi in runs:
        sl = (slice(b, b + 1), slice(None), slice(lo, hi))
        plan = _natural_plan(pattern, hi - lo, a.hq, a.hkv, FAST_QUERY_BLOCK)
        out[sl], lse[sl] = _FastAttention.apply(q[sl], k[sl], v[sl], plan, a.scale)
    return out, lse


# Two engines of ``chunked.ENGINES``: the whole sequence (``plan_whole``, ``attend_whole``), and
# one call per document (``plan_documents``, ``attend_documents``).
def attend_whole(q, k, v, pattern, a, plan):
    return _FastAttention.apply(q, k, v, plan, a.scale)
