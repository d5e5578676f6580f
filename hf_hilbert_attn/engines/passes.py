"""The blockwise engine's plan: passes of a config (or the sinks) over position-sorted queries
and keys, cut into blocks with the summaries that decide which masks a block needs
(``blockwise.py`` runs them).

Work is planned in position space, config by config (``planning.priority`` order). Config ``i``
allows a pair only inside one (segment, dilation class) group, so its queries and keys are
sorted by (group, position) and cut into tiles of ``CHUNK_Q`` queries and chunks of at most
``CHUNK_K`` keys; a tile meets only the keys of its own groups. Sliding windows (one group per
class) meet only the band of keys within ``w_i`` of a tile's queries (O(S * w_i / r_i) work).
Config ``i`` masks the pairs an earlier config covers; the sinks come last, every query against
the keys ``< sink_tokens``. Passes merge by log-sum-exp; a block's mask is
``DilatedPattern.config_allowed`` (or the distance ``p - s``) plus causality and documents, and
min/max summaries skip blocks without a pair. Memory: O(B * H * CHUNK_Q * CHUNK_K) per block
plus O(B * H * S * D) accumulators, never O(Sq * Sk).
"""

from __future__ import annotations

import torch

from ..pattern import DilatedPattern
from ..plan_cache import PlanCache
from ..planning import class_uniform, config_meets, covered_window, priority

CHUNK_Q = 512
CHUNK_K = 512
# Scores per block (B * heads * queries * keys): the query tile shrinks when B * heads is large.
MAX_BLOCK_ELEMENTS = 1 << 23
# Sliding windows: query tiles of about a quarter of the keys a query uses in its window (at
# least SLIDING_CQ_MIN); measured on CPU at S = 8192 (tiles of 64-512, windows 512-8192).
SLIDING_CQ_MIN = 64
SLIDING_DIV = 4

# What a block needs of its own pass's rule, per pair: nothing (every pair is in the pass's
# group and window), the sliding window as a distance, or the config's whole rule.
_OWN_NONE, _OWN_WINDOW, _OWN_RULE = 0, 1, 2


class _Pass:
    """One config (per_head: one dilation class of it), or the sinks (``config is None``), over
    one set of batch rows. ``q_order``/``k_order``: storage indices sorted by (group, position);
    ``tiles``: ``(q_lo, q_hi, chunks)`` slices of ``q_order`` with, per key chunk (a slice of
    ``k_order``), ``(k_lo, k_hi, need_causal, own, need_docs, dedupe_configs, covered)``:
    ``own`` one of ``_OWN_*``; ``dedupe_configs`` the earlier configs whose rule masks pairs of
    the block; ``covered`` a distance ``W`` (0: none) below which an earlier config owns every
    pair of the block.
    """

    __slots__ = ("config", "causal", "rows", "heads", "head_ids", "kv_ids", "q_order", "q_pos",
                 "q_doc", "k_order", "k_pos", "k_doc", "tiles")


def _lex_order(group: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Indices sorting by ``group`` then ``pos`` (ties in both may come in any order)."""
    p_min, p_max = int(pos.min()), int(pos.max())
    g_min, g_max = int(group.min()), int(group.max())
    if g_min == g_max and bool((pos[1:] >= pos[:-1]).all()):  # sorted already (one class of
        return torch.arange(pos.numel(), device=pos.device)  # ascending positions): no sort
    span = p_max - p_min + 1
    if (g_max - g_min + 1) * span < 2**62:  # one sort of a combined key
        return torch.sort((group - g_min) * span + (pos - p_min)).indices
    order = torch.sort(pos, stable=True).indices
    return order.index_select(0, torch.sort(group.index_select(0, order), stable=True).indices)


def _lex_search(kg: torch.Tensor, kpos: torch.Tensor, g: torch.Tensor, p: torch.Tensor,
                right: bool) -> torch.Tensor:
    """Insertion points of the pairs ``(g, p)`` into keys sorted by (``kg``, ``kpos``)."""
    k_min, k_max = int(kpos.min()), int(kpos.max())
    base, span = k_min - 1, k_max - k_min + 3  # clamped queries land in [0, span)
    g_min, g_max = min(int(kg.min()), int(g.min())), max(int(kg.max()), int(g.max()))
    if (g_max - g_min + 1) * span < 2**62:
        keys = (kg - g_min) * span + (kpos - base)
        at = (g - g_min) * span + (p.clamp(base, k_max + 1) - base)
        return torch.searchsorted(keys, at, right=right)
    # positions too far apart for one int64 key: search each group's slice of the keys
    out = torch.empty_like(g)
    for gv in torch.unique(g).tolist():
        sel = g == gv
        one = kg.new_tensor([gv])
        a, b = (int(torch.searchsorted(kg, one, right=side)) for side in (False, True))
        out[sel] = a + torch.searchsorted(kpos[a:b], p[sel], right=right)
    return out


def _tile_bounds(counts: list, cq: int) -> list:
    """Cut consecutive groups into tiles of at most ``cq`` queries: small groups packed together,
    a larger one in near-equal tiles of its own (a tile never pays for a big neighbour's keys)."""
    bounds, start, cur = [], 0, 0
    for n in counts:
        if cur and cur + n > cq:  # the packed tile so far is full
            bounds.append((start, start + cur))
            start, cur = start + cur, 0
        if n <= cq:
            cur += n
            continue
        pieces = -(-n // cq)
        cuts = [start + n * j // pieces for j in range(pieces + 1)]
        bounds.extend(zip(cuts[:-1], cuts[1:]))
        start += n
    if cur:
        bounds.append((start, start + cur))
    return bounds


def _merge_ranges(ranges, ck: int) -> list:
    """Key ranges ``[(a, b)]`` sorted by ``a`` (overlaps allowed) as disjoint chunks of at most
    ``ck`` keys; a range near the previous chunk joins it, gap included (masked), so split or
    small bands do not become many tiny blocks."""
    chunks, cs, ce = [], None, None
    for a, b in ranges:
        a = a if ce is None else max(a, ce)  # disjoint: a key in two chunks would count twice
        if a >= b:
            continue
        if ce is not None and b - cs <= ck:
            ce = b
            continue
        if ce is not None:
            chunks.append((cs, ce))
        if b - a > ck:  # near-equal pieces: no small remainder block
            pieces = -(-(b - a) // ck)
            cuts = [a + (b - a) * n // pieces for n in range(pieces + 1)]
            chunks.extend(zip(cuts[:-2], cuts[1:-1]))
            a = cuts[-2]
        cs, ce = a, b
    if ce is not None:
        chunks.append((cs, ce))
    return chunks


def _range_min_max(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor):
    """Min and max of ``x[..., a:b]`` for each non-empty range of ``starts``/``ends`` (``x``
    ``[n]`` or ``[Bd, n]``, reduced over the batch too): two ``[len(starts)]`` tensors. Work
    and memory O(len(starts) * longest range), in batches of at most one block's size."""
    width = int((ends - starts).max())
    step = max(1, CHUNK_Q * CHUNK_K // (width * (x.shape[0] if x.dim() == 2 else 1)))
    parts = []
    for n in range(0, starts.numel(), step):
        a, b = starts[n:n + step], ends[n:n + step]
        # a short range repeats its last element, which changes neither its min nor its max
        idx = torch.minimum(a[:, None] + torch.arange(width, device=x.device), b[:, None] - 1)
        parts.append(torch.aminmax(x[..., idx], dim=-1))
    lo, hi = (torch.cat(t, -1) for t in zip(*parts))
    return (lo.amin(0), hi.amax(0)) if x.dim() == 2 else (lo, hi)


def _band_chunks(pattern, i, causal, q_pos, qg, k_pos, kg, counts, tile_start, multi_group, ck,
                 covs):
    """Per tile, the key chunks of sliding config ``i``: for each group (class) of the tile,
    its keys within ``w_i`` of the group's queries, less the keys every one of those queries
    already gets from an earlier config (``covs``), as :func:`_merge_ranges` chunks (positions
    and groups sorted by (group, position))."""
    w = pattern.segment_lengths[i]
    dev = q_pos.device
    group_start = torch.tensor(counts, device=dev).cumsum(0) - torch.tensor(counts, device=dev)
    # a tile holds whole small groups or part of one large group: cut at both kinds of start
    seg = torch.unique(torch.cat([tile_start, group_start]))
    seg_end = torch.cat([seg[1:], seg.new_tensor([q_pos.numel()])])
    tile_of = torch.searchsorted(tile_start, seg, right=True) - 1
    g = qg.index_select(0, seg)
    qmin, qmax = q_pos.index_select(0, seg), q_pos.index_select(0, seg_end - 1)  # ascending
    multi = torch.tensor(multi_group, device=dev).index_select(0, tile_of)
    cov = torch.where(multi, covs[0], covs[1])
    # keys s with p - s < cov for every query p are an earlier config's: causal leaves
    # [qmin - w + 1, qmax - cov]; non-causal also [qmin + cov, qmax + w - 1] (one band at cov 0)
    pieces = [(qmin - (w - 1), qmax - cov)] + ([] if causal else [(qmin + cov, qmax + (w - 1))])
    cols = [list(zip(_lex_search(kg, k_pos, g, lo, right=False).tolist(),
                     _lex_search(kg, k_pos, g, hi, right=True).tolist())) for lo, hi in pieces]
    per_tile = [[] for _ in range(tile_start.numel())]
    for n, t in enumerate(tile_of.tolist()):
        per_tile[t].extend(c[n] for c in cols)
    return [_merge_ranges(rs, ck) for rs in per_tile]


def _groups(pattern, i, q_pos, k_pos, q_doc, k_doc):
    """Group ids of the queries and keys of pass ``i``: (segment, class) of config ``i``; the
    sinks: every query meets the sink keys, grouped by document when the rows share document
    ids (a tile of one document meets only that document's sinks)."""
    if i is None:
        if q_doc is not None and q_doc.shape[0] == 1:
            return q_doc[0], k_doc[0]
        return torch.zeros_like(q_pos), torch.zeros_like(k_pos)
    r = pattern.dilation_rates[i]
    (qseg, qcls), (kseg, kcls) = (pattern.segment_and_class(i, p) for p in (q_pos, k_pos))
    return qseg * r + qcls, kseg * r + kcls


def _chunks(pattern, i, causal, ps, qg, kg, cq, covs):
    """The pass's query tiles (``bounds``, start and end of their query rows, first and last groups)
    and their key chunks (``c_tile``, ``c_lo``, ``c_hi``: tile and key rows of each)."""
    sliding = i is not None and pattern.sliding
    if sliding:
        # A tile's band holds ~(tile + window) keys of its class: small tiles waste less, at
        # more blocks, whose key chunks grow to keep their size (and memory bound).
        w, r = pattern.configs[i]
        useful = (w - covs[1]) // r
        small = min(cq, max(SLIDING_CQ_MIN, 1 << max(0, (useful // SLIDING_DIV).bit_length() - 1)))
        ck, cq = CHUNK_K * cq // small, small
    counts = torch.unique_consecutive(qg, return_counts=True)[1].tolist()
    bounds = _tile_bounds(counts, cq)
    dev = qg.device
    starts, ends = (torch.tensor(x, device=dev) for x in zip(*bounds))
    g_lo, g_hi = qg[starts], qg[ends - 1]
    if sliding:
        band = _band_chunks(pattern, i, causal, ps.q_pos, qg, ps.k_pos, kg, counts, starts,
                            (g_lo != g_hi).tolist(), ck, covs)
        flat = torch.tensor([(t, x, y) for t, rs in enumerate(band) for x, y in rs],
                            dtype=torch.int64, device=dev)
        c_tile, c_lo, c_hi = flat.view(-1, 3).T.contiguous()
    else:  # every key of the tile's groups, in chunks of CHUNK_K
        k_lo = torch.searchsorted(kg, g_lo, side="left")
        k_hi = torch.searchsorted(kg, g_hi, side="right")
        n_ch = torch.div(k_hi - k_lo + (CHUNK_K - 1), CHUNK_K, rounding_mode="floor")
        c_tile = torch.repeat_interleave(torch.arange(len(bounds), device=dev), n_ch)
        first = (n_ch.cumsum(0) - n_ch).index_select(0, c_tile)
        nth = torch.arange(c_tile.numel(), device=dev) - first  # chunk number in its tile
        c_lo = k_lo.index_select(0, c_tile) + nth * CHUNK_K
        c_hi = torch.minimum(c_lo + CHUNK_K, k_hi.index_select(0, c_tile))
    return (bounds, starts, ends, g_lo, g_hi), (c_tile, c_lo, c_hi)


def _owners(pattern, i, earlier, causal, q_rng, k_rng, single, covs):
    """Per block (query range ``q_rng``, key range ``k_rng``, tensors over the blocks):
    ``(keep, own, covered, dedupe)``: whether the pass may own a pair of it, the pass's own rule
    needed per pair (``_OWN_*``), the distance below which an earlier config owns every pair
    (0: none), and per earlier config whether its rule masks pairs of the block."""
    (qmin, qmax), (kmn, kmx) = q_rng, k_rng
    if i is None:  # sink keys are chosen by position: no rule of their own
        keep = kmn <= qmax if causal else torch.ones_like(single)
        own = torch.full_like(kmn, _OWN_NONE)
    else:  # several groups in one tile: the config's rule, per pair
        keep = config_meets(pattern.segment_lengths[i], pattern.sliding, causal, q_rng, k_rng)
        own = torch.where(single, _OWN_NONE, _OWN_RULE)
    covered = torch.zeros_like(kmn)
    if pattern.sliding and i is not None:
        w = pattern.segment_lengths[i]
        # one class: the rule is the window, needed unless every pair lies inside it (causal:
        # pairs with s > p are masked anyway)
        inside = (qmax - kmn < w) & ((kmx - qmin < w) | causal)
        own = torch.where(single & ~inside, _OWN_WINDOW, own)
    # Earlier configs (all of them for the sinks): a block none of whose pairs the pass can own
    # is skipped (segments: a class-uniform config and one of its segments; sliding: inside a
    # window whose class test always holds); any other overlap is masked per pair.
    if pattern.sliding:
        cov = torch.where(single, covs[1], covs[0])
        keep &= ~((cov > 0) & (qmax - kmn < cov) & ((kmx - qmin < cov) | causal))
        covered = torch.where((cov > 0) & (kmn - qmax < cov) & (qmin - kmx < cov), cov, covered)
    r_i = None if i is None else pattern.dilation_rates[i]
    dedupe = []
    for j in earlier:
        cfg = pattern.configs[j]
        meet = config_meets(cfg[0], pattern.sliding, False, q_rng, k_rng)
        if pattern.sliding:  # class-uniform configs are inside `covered`; the others mask
            meet = meet & ~torch.where(single, class_uniform(cfg, r_i, True),
                                       class_uniform(cfg, None, True))
        elif class_uniform(cfg, None, False):  # owns every pair inside one of its segments
            seg = torch.div(qmin, cfg[0], rounding_mode="floor")
            keep &= ~((seg == torch.div(torch.stack([qmax, kmn, kmx]), cfg[0],
                                        rounding_mode="floor")).all(0))
        dedupe.append(meet)
    return keep, own, covered, dedupe


def _make_pass(pattern, i, earlier, rows, heads, hq, hkv, q, k, causal, batch_rows):
    """The pass of config ``i`` (``None``: the sink tokens, against the keys given) over the
    queries ``q`` and keys ``k`` (each ``(storage index, position, doc id)``), or None when it
    has no block. ``earlier``: the indices of the configs before it in priority
    (``planning.priority``; the sinks: every config)."""
    if q[0].numel() == 0 or k[0].numel() == 0:
        return None
    (q_idx, q_pos, q_doc), (k_idx, k_pos, k_doc) = q, k
    qg, kg = _groups(pattern, i, q_pos, k_pos, q_doc, k_doc)
    # the pass's queries and keys (and their group ids) sorted by (group, position)
    qo, ko = _lex_order(qg, q_pos), _lex_order(kg, k_pos)
    qg, kg = qg.index_select(0, qo), kg.index_select(0, ko)
    ps = _Pass()
    ps.config, ps.causal, ps.rows, ps.heads = i, causal, rows, heads
    head_list = list(range(hq))[heads]
    ps.head_ids = torch.tensor(head_list, dtype=torch.int64, device=q_pos.device)
    # A strict subset of heads reads its key/value heads through an index (block-sized copies);
    # all heads use the grouped view q [B, Hkv, G * cq, D], so K/V are never expanded.
    ps.kv_ids = None if len(head_list) == hq else ps.head_ids // (hq // hkv)
    # (index_select: advanced indexing is several times slower on CPU)
    ps.q_order, ps.q_pos = q_idx.index_select(0, qo), q_pos.index_select(0, qo)
    ps.k_order, ps.k_pos = k_idx.index_select(0, ko), k_pos.index_select(0, ko)
    ps.q_doc = None if q_doc is None else q_doc.index_select(1, qo)
    ps.k_doc = None if k_doc is None else k_doc.index_select(1, ko)
    cq = max(16, min(CHUNK_Q, MAX_BLOCK_ELEMENTS // max(1, batch_rows * len(head_list) * CHUNK_K)))
    # sliding windows: (multi, single), the window below which an earlier config owns every pair
    # of a block whose tile holds several class groups / one (planning.covered_window); segments 0
    cfgs = [pattern.configs[j] for j in earlier]
    covs = (covered_window(cfgs, None), covered_window(
        cfgs, None if i is None else pattern.dilation_rates[i])) if pattern.sliding else (0, 0)
    (bounds, starts, ends, g_lo, g_hi), (c_tile, c_lo, c_hi) = _chunks(
        pattern, i, causal, ps, qg, kg, cq, covs)
    if c_tile.numel() == 0:
        return None
    # Summaries per chunk (the tile's queries, the chunk's keys), all chunks of the pass at once.
    qmin, qmax = (x.index_select(0, c_tile) for x in _range_min_max(ps.q_pos, starts, ends))
    kmn, kmx = _range_min_max(ps.k_pos, c_lo, c_hi)
    single = (g_lo == g_hi).index_select(0, c_tile)
    need_causal = kmx > qmin if causal else torch.zeros_like(single)
    keep, own, covered, dedupe = _owners(pattern, i, earlier, causal, (qmin, qmax), (kmn, kmx),
                                         single, covs)
    need_docs = torch.zeros_like(keep)
    if ps.q_doc is not None:
        dmin, dmax = (x.index_select(0, c_tile) for x in _range_min_max(ps.q_doc, starts, ends))
        kdmn, kdmx = _range_min_max(ps.k_doc, c_lo, c_hi)
        keep &= (kdmx >= 0) & (kdmx >= dmin) & (kdmn <= dmax)
        need_docs = ~((kdmn == kdmx) & (kdmn >= 0) & (dmin == dmax) & (kdmn == dmin))
    ids = keep.nonzero().flatten()
    if ids.numel() == 0:
        return None
    cols = [x.index_select(0, ids).tolist() for x in (c_tile, c_lo, c_hi, need_causal, own,
                                                        need_docs, covered, *dedupe)]
    ps.tiles = []
    for t, a, b, nc, ow, nd, cv, *row in zip(*cols):  # row: per earlier config, dedupe or not
        if not ps.tiles or ps.tiles[-1][:2] != bounds[t]:
            ps.tiles.append((*bounds[t], []))
        ps.tiles[-1][2].append((a, b, nc, ow, nd, tuple(j for j, f in zip(earlier, row) if f), cv))
    return ps


def _plan(pattern: DilatedPattern, a, causal: bool) -> list:
    """All passes for the inputs ``a`` (an ``AttnInputs``); depends on positions only."""
    qpos, kpos = a.q_positions, a.k_positions  # [Bp, S]
    # Rows with equal positions (e.g. [1, S] expanded to the batch) share one plan; only their
    # document ids (masks) differ.
    shared = torch.equal(qpos, qpos[:1].expand_as(qpos)) and torch.equal(kpos, kpos[:1].expand_as(kpos))
    dev = qpos.device
    passes = []

    def take(idx, pos, doc):  # (storage index, position, doc id) of the rows idx
        return idx, pos.index_select(0, idx), None if doc is None else doc.index_select(1, idx)

    for b in ([None] if shared else range(a.batch)):
        rows = slice(None) if b is None else slice(b, b + 1)
        # ([1, S] positions serve every row: q and k may differ in their leading size)
        qp, kp = (p[0 if b is None or p.shape[0] == 1 else b] for p in (qpos, kpos))
        qd = kd = None
        if a.q_doc_ids is not None:
            pick = slice(None) if (b is None or a.q_doc_ids.shape[0] == 1) else rows
            qd, kd = a.q_doc_ids[pick], a.k_doc_ids[pick]
        n_rows = a.batch if b is None else 1
        q_all, k_all = torch.arange(a.sq, device=dev), torch.arange(a.sk, device=dev)
        work = []  # (config or None, configs before it, heads, query rows, key rows)
        order = priority(pattern)
        for n, i in enumerate(order):
            r = pattern.dilation_rates[i]
            if pattern.query_dilation == "per_head" and r > 1:
                # Head h uses class h % r: one pass per class present among the heads.
                qcls, kcls = (pattern.segment_and_class(i, p)[1] for p in (qp, kp))
                for c in sorted({h % r for h in range(a.hq)}):
                    qs = (qcls == c).nonzero().flatten()
                    if qs.numel():  # (a decode step's query is in one class of r)
                        work.append((i, order[:n], slice(c, None, r), qs,
                                     (kcls == c).nonzero().flatten()))
            else:
                work.append((i, order[:n], slice(None), q_all, k_all))
        if pattern.sink_tokens:  # last: the union gives each pair to a config first
            ks = (kp < pattern.sink_tokens).nonzero().flatten()
            if kd is not None and kd.shape[0] == 1:
                ks = ks[kd[0].index_select(0, ks) >= 0]  # padding is never a sink
            work.append((None, order, slice(None), q_all, ks))
        made = (_make_pass(pattern, i, earlier, rows, heads, a.hq, a.hkv, take(qs, qp, qd),
                           take(ks, kp, kd), causal, n_rows) for i, earlier, heads, qs, ks in work)
        passes += [ps for ps in made if ps is not None]
    return passes


# Plans by positions (``plan_cache``), keyed also by what ``_plan`` reads besides them and the
# block sizes (tests change them); at most 16 (index tensors of O(S * configs)).
_PASS_CACHE = PlanCache(8, per_key=2)


def plan(pattern: DilatedPattern, a, causal: bool, q=None) -> list:
    """The blockwise engine's plan, its interface in ``chunked.ENGINES`` (it takes every call;
    ``q`` unused): :func:`_plan`, made once per (pattern, positions, document ids, causal,
    shapes)."""
    key = ("passes", pattern, bool(causal), a.batch, a.hq, a.hkv, a.sq, a.sk, CHUNK_Q, CHUNK_K,
           MAX_BLOCK_ELEMENTS, SLIDING_CQ_MIN, SLIDING_DIV)
    return _PASS_CACHE.get_or_make(key, (a.q_positions, a.k_positions, a.q_doc_ids, a.k_doc_ids),
                                   lambda: _plan(pattern, a, causal))
