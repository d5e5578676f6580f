"""The memory-efficient PyTorch path: ``dilated_attention(..., backend="torch")``, and the op's
path wherever the Triton kernels do not run (CPU, float64, other head sizes, positions the
kernels cannot plan).

It computes exactly what ``reference.reference_attention`` computes, block by block in position
space, never materialising ``[Sq, Sk]``, with a FlashAttention-style backward.
"""

from __future__ import annotations

import torch

from .inputs import document_ranges
from .numerics import accum_dtype, finite_or_zero, merge_partials
from .pattern import DilatedPattern
from .plan_cache import PlanCache
from .planning import class_uniform, config_meets, covered_window, covers, nests, priority

__all__ = ["chunked_attention", "CHUNK_Q", "CHUNK_K"]

# --------------------------------------------------------------------------------------------
# Work is planned in position space, config by config. Config ``i`` allows a pair only inside
# one (segment, dilation class) group (``DilatedPattern.segment_and_class``), so for each config
# the queries and keys are sorted by (group, position) and cut into tiles of ``CHUNK_Q`` queries
# and chunks of at most ``CHUNK_K`` keys; a tile meets only the keys of its own groups. Sliding
# windows have no segments (one group per class), so there a tile meets only the band of its
# class's keys that lie within ``w_i`` of its queries (searched in the sorted keys): the work is
# O(S * w_i / r_i), not O(S^2 / r_i); tiles are smaller and chunks longer (same block size), as
# a band is a diagonal strip. Under the union rule a pair belongs to the *first* config
# that allows it, so config ``i`` masks the pairs an earlier config already covered; the sink
# tokens come last, as one pass of every query against the keys at positions
# ``< sink_tokens``, masking the pairs any config allows. Passes are merged by log-sum-exp. Per
# block, the mask comes from ``DilatedPattern.config_allowed`` (or from the distance ``p - s``
# alone, where the rule reduces to a window) plus causality and document ids, and cheap min/max
# summaries skip blocks that cannot hold a pair the pass owns. Memory is
# O(B * H * CHUNK_Q * CHUNK_K) per block plus O(B * H * S * D) accumulators, never O(Sq * Sk).
# --------------------------------------------------------------------------------------------

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
    """One config (in per_head mode, one dilation class of it), or the sink tokens
    (``config is None``), over one set of batch rows.

    ``q_order``/``k_order`` are storage indices sorted by (group, position); ``tiles`` holds
    ``(q_lo, q_hi, chunks)`` slices of ``q_order`` with, per key chunk (a slice of ``k_order``),
    ``(k_lo, k_hi, need_causal, own, need_docs, dedupe_configs, covered)``: ``own`` is one of
    ``_OWN_*``; ``dedupe_configs`` the earlier configs whose rule masks pairs of the block;
    ``covered`` a distance ``W`` (0: none) such that an earlier config owns every pair of the
    block with ``|p - s| < W``.
    """

    __slots__ = ("config", "causal", "rows", "heads", "head_ids", "kv_ids", "q_order", "q_pos",
                 "q_doc", "k_order", "k_pos", "k_doc", "tiles")


def _lex_order(group: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Indices sorting by ``group`` then ``pos`` (ties in both may come in any order)."""
    if pos.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=pos.device)
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
    g_min = min(int(kg.min()), int(g.min()))
    g_max = max(int(kg.max()), int(g.max()))
    if (g_max - g_min + 1) * span < 2**62:
        keys = (kg - g_min) * span + (kpos - base)
        at = (g - g_min) * span + (p.clamp(base, k_max + 1) - base)
        return torch.searchsorted(keys, at, right=right)
    # positions too far apart for one int64 key: search each group's slice of the keys
    out = torch.empty_like(g)
    for gv in torch.unique(g).tolist():
        sel = g == gv
        one = kg.new_tensor([gv])
        a = int(torch.searchsorted(kg, one))
        b = int(torch.searchsorted(kg, one, right=True))
        out[sel] = a + torch.searchsorted(kpos[a:b], p[sel], right=right)
    return out


def _tile_bounds(counts: list, cq: int) -> list:
    """Cut a sequence of consecutive groups into tiles of at most ``cq`` queries.

    Small groups are packed together; a group larger than ``cq`` gets tiles of its own (near
    equal sizes), so a tile never pays for a big neighbour's keys.
    """
    bounds, start, cur = [], 0, 0
    for n in counts:
        if n > cq:
            if cur:
                bounds.append((start, start + cur))
                start, cur = start + cur, 0
            pieces = -(-n // cq)
            for j in range(pieces):
                size = n * (j + 1) // pieces - n * j // pieces
                bounds.append((start, start + size))
                start += size
            continue
        if cur + n > cq:
            bounds.append((start, start + cur))
            start, cur = start + cur, 0
        cur += n
    if cur:
        bounds.append((start, start + cur))
    return bounds


def _merge_ranges(ranges, ck: int) -> list:
    """Key ranges ``[(a, b)]`` sorted by ``a`` (overlaps allowed) as disjoint chunks of at most
    ``ck`` keys. A range near the previous chunk joins it, gap included (the gap's keys
    are masked), so a class whose band is split in two, or small neighbouring bands, do not
    become many tiny blocks."""
    chunks, cs, ce = [], None, None
    for a, b in ranges:
        if ce is not None:
            a = max(a, ce)  # disjoint: a key in two chunks would count twice
            if a >= b:
                continue
            if b - cs <= ck:
                ce = b
                continue
            chunks.append((cs, ce))
        elif a >= b:
            continue
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
    lo, hi = [], []
    for n in range(0, starts.numel(), step):
        a, b = starts[n:n + step], ends[n:n + step]
        # a short range repeats its last element, which changes neither its min nor its max
        idx = torch.minimum(a[:, None] + torch.arange(width, device=x.device), b[:, None] - 1)
        vals = x[..., idx]
        lo.append(vals.amin(-1))
        hi.append(vals.amax(-1))
    lo, hi = torch.cat(lo, -1), torch.cat(hi, -1)
    if x.dim() == 2:
        lo, hi = lo.amin(0), hi.amax(0)
    return lo, hi


def _covered_distances(pattern, earlier, i) -> tuple:
    """Sliding windows: ``(multi, single)``, the window below which an earlier config owns every
    pair of a block of pass ``i`` (``None``: the sinks) whose tile holds several class groups /
    one (``planning.covered_window``); ``(0, 0)`` for segments."""
    if not pattern.sliding:
        return 0, 0
    cfgs = [pattern.configs[j] for j in earlier]
    r = None if i is None else pattern.dilation_rates[i]
    return covered_window(cfgs, None), covered_window(cfgs, r)


def _band_chunks(pattern, i, causal, q_pos, qg, k_pos, kg, counts, bounds, multi_group, ck,
                 covs):
    """Per tile, the key chunks of sliding config ``i``: for each group (class) of the tile,
    its keys within ``w_i`` of the group's queries, less the keys every one of those queries
    already gets from an earlier config (``covs``: :func:`_covered_distances`), as
    :func:`_merge_ranges` chunks. ``q_pos``/``qg`` and ``k_pos``/``kg`` are sorted by (group, position)."""
    w = pattern.segment_lengths[i]
    dev = q_pos.device
    tile_start = torch.tensor([b[0] for b in bounds], device=dev)
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
    pieces = [(qmin - (w - 1), qmax - cov)]
    if not causal:
        pieces.append((qmin + cov, qmax + (w - 1)))
    cols = []
    for lo, hi in pieces:
        cols.append(_lex_search(kg, k_pos, g, lo, right=False).tolist())
        cols.append(_lex_search(kg, k_pos, g, hi, right=True).tolist())
    per_tile = [[] for _ in bounds]
    for n, t in enumerate(tile_of.tolist()):
        per_tile[t].extend((cols[2 * c][n], cols[2 * c + 1][n]) for c in range(len(pieces)))
    return [_merge_ranges(rs, ck) for rs in per_tile]


def _make_pass(pattern, i, earlier, rows, heads, hq, group_size, q_idx, q_pos, q_doc, k_idx,
               k_pos, k_doc, causal, batch_rows):
    """The pass of config ``i`` (``None``: the sink tokens, against the keys given) over these
    queries and keys, or None when it has no block. ``earlier``: the indices of the configs
    before it in priority (``planning.priority``; the sinks: every config)."""
    if q_idx.numel() == 0 or k_idx.numel() == 0:
        return None
    if i is None:
        # Every query meets the sink keys. With document ids shared by the rows, group by
        # document, so a tile of one document meets only that document's sinks.
        if q_doc is not None and q_doc.shape[0] == 1:
            qg, kg = q_doc[0], k_doc[0]
        else:
            qg, kg = torch.zeros_like(q_pos), torch.zeros_like(k_pos)
    else:
        r = pattern.dilation_rates[i]
        qseg, qcls = pattern.segment_and_class(i, q_pos)
        kseg, kcls = pattern.segment_and_class(i, k_pos)
        qg, kg = qseg * r + qcls, kseg * r + kcls
    qo, ko = _lex_order(qg, q_pos), _lex_order(kg, k_pos)
    ps = _Pass()
    ps.config, ps.causal, ps.rows, ps.heads = i, causal, rows, heads
    head_list = list(range(hq))[heads]
    ps.head_ids = torch.tensor(head_list, dtype=torch.int64, device=q_pos.device)
    # A strict subset of heads reads its key/value heads through an index (block-sized copies);
    # all heads use the grouped view q [B, Hkv, G * cq, D], so K/V are never expanded.
    ps.kv_ids = None if len(head_list) == hq else torch.div(ps.head_ids, group_size, rounding_mode="floor")
    # (index_select: advanced indexing is several times slower on CPU)
    ps.q_order, ps.q_pos = q_idx.index_select(0, qo), q_pos.index_select(0, qo)
    ps.k_order, ps.k_pos = k_idx.index_select(0, ko), k_pos.index_select(0, ko)
    ps.q_doc = None if q_doc is None else q_doc.index_select(1, qo)
    ps.k_doc = None if k_doc is None else k_doc.index_select(1, ko)
    qg, kg = qg.index_select(0, qo), kg.index_select(0, ko)

    cq = max(16, min(CHUNK_Q, MAX_BLOCK_ELEMENTS // max(1, batch_rows * len(head_list) * CHUNK_K)))
    sliding = i is not None and pattern.sliding
    covs = _covered_distances(pattern, earlier, i)
    if sliding:
        # A tile's band holds ~(tile + window) keys of its class, of which each query uses
        # the window: small tiles waste less, at more blocks; their key chunks grow so that
        # blocks keep their size (and memory bound).
        w, r = pattern.configs[i]
        useful = (w - covs[1]) // r
        small = min(cq, max(SLIDING_CQ_MIN, 1 << max(0, (useful // SLIDING_DIV).bit_length() - 1)))
        ck, cq = CHUNK_K * cq // small, small
    counts = torch.unique_consecutive(qg, return_counts=True)[1].tolist()
    bounds = _tile_bounds(counts, cq)
    starts = torch.tensor([b[0] for b in bounds], device=qg.device)
    ends = torch.tensor([b[1] - 1 for b in bounds], device=qg.device)
    g_lo, g_hi = qg[starts], qg[ends]
    multi_group = (g_lo != g_hi).tolist()
    dev = qg.device
    if sliding:
        band = _band_chunks(pattern, i, causal, ps.q_pos, qg, ps.k_pos, kg, counts, bounds,
                            multi_group, ck, covs)
        c_tile = torch.tensor([t for t, rs in enumerate(band) for _ in rs], dtype=torch.int64,
                              device=dev)
        c_lo = torch.tensor([x for rs in band for x, _ in rs], dtype=torch.int64, device=dev)
        c_hi = torch.tensor([y for rs in band for _, y in rs], dtype=torch.int64, device=dev)
    else:  # every key of the tile's groups, in chunks of CHUNK_K
        k_lo = torch.searchsorted(kg, g_lo, side="left")
        k_hi = torch.searchsorted(kg, g_hi, side="right")
        n_ch = torch.div(k_hi - k_lo + (CHUNK_K - 1), CHUNK_K, rounding_mode="floor")
        c_tile = torch.repeat_interleave(torch.arange(len(bounds), device=dev), n_ch)
        first = (n_ch.cumsum(0) - n_ch).index_select(0, c_tile)
        nth = torch.arange(c_tile.numel(), device=dev) - first  # chunk number in its tile
        c_lo = k_lo.index_select(0, c_tile) + nth * CHUNK_K
        c_hi = torch.minimum(c_lo + CHUNK_K, k_hi.index_select(0, c_tile))
    if c_tile.numel() == 0:
        return None
    # Summaries per chunk (the tile's queries, the chunk's keys), all chunks of the pass at once.
    qmin, qmax = (x.index_select(0, c_tile) for x in _range_min_max(ps.q_pos, starts, ends + 1))
    kmn, kmx = _range_min_max(ps.k_pos, c_lo, c_hi)
    single = (g_lo == g_hi).index_select(0, c_tile)
    need_causal = kmx > qmin if causal else torch.zeros_like(single)
    if i is None:  # sink keys: every query may take them
        keep = kmn <= qmax if causal else torch.ones_like(single)
    else:
        keep = config_meets(pattern.segment_lengths[i], pattern.sliding, causal, (qmin, qmax),
                            (kmn, kmx))
    if i is None:  # sink keys are chosen by position: no rule of their own
        own = torch.full_like(kmn, _OWN_NONE)
    else:  # several groups in one tile: the config's rule, per pair
        own = torch.where(single, _OWN_NONE, _OWN_RULE)
    if sliding:
        w = pattern.segment_lengths[i]
        # one class: the rule is the window, needed unless every pair lies inside it (causal:
        # pairs with s > p are masked anyway)
        inside = qmax - kmn < w
        if not causal:
            inside &= kmx - qmin < w
        own = torch.where(single & ~inside, _OWN_WINDOW, own)
    covered = torch.zeros_like(kmn)
    # Earlier configs (all of them for the sinks): a block none of whose pairs the pass can own
    # is skipped (segments: rate 1 and one segment; sliding: inside a window whose class test
    # always holds); any other overlap is masked per pair.
    dedupe = []
    r_i = None if i is None else pattern.dilation_rates[i]
    if pattern.sliding:
        cov = torch.where(single, covs[1], covs[0])
        within = (cov > 0) & (qmax - kmn < cov)
        if not causal:
            within &= kmx - qmin < cov
        keep &= ~within
        covered = torch.where((cov > 0) & (kmn - qmax < cov) & (qmin - kmx < cov), cov, covered)
    for j in earlier:
        cfg = pattern.configs[j]
        meet = config_meets(cfg[0], pattern.sliding, False, (qmin, qmax), (kmn, kmx))
        if pattern.sliding:  # class-uniform configs are inside `covered`; the others mask
            meet = meet & ~torch.where(single, class_uniform(cfg, r_i, True),
                                       class_uniform(cfg, None, True))
        elif class_uniform(cfg, None, False):  # owns every pair inside one of its segments
            seg = torch.div(qmin, cfg[0], rounding_mode="floor")
            keep &= ~((seg == torch.div(torch.stack([qmax, kmn, kmx]), cfg[0],
                                        rounding_mode="floor")).all(0))
        dedupe.append(meet)
    need_docs = torch.zeros_like(keep)
    if ps.q_doc is not None:
        dmin, dmax = (x.index_select(0, c_tile) for x in _range_min_max(ps.q_doc, starts, ends + 1))
        kdmn, kdmx = _range_min_max(ps.k_doc, c_lo, c_hi)
        keep &= (kdmx >= 0) & (kdmx >= dmin) & (kdmn <= dmax)
        need_docs = ~((kdmn == kdmx) & (kdmn >= 0) & (dmin == dmax) & (kdmn == dmin))
    ids = keep.nonzero().flatten()
    if ids.numel() == 0:
        return None
    dd = (torch.stack(dedupe, 1) if dedupe else torch.zeros(len(single), 0, dtype=torch.bool,
                                                               device=dev)).index_select(0, ids)
    cols = [x.index_select(0, ids).tolist() for x in (c_tile, c_lo, c_hi, need_causal, own,
                                                        need_docs, covered)]
    tiles = []
    for (t, a, b, nc, ow, nd, cv), row in zip(zip(*cols), dd.tolist()):
        if not tiles or tiles[-1][0] != t:
            tiles.append((t, []))
        tiles[-1][1].append((a, b, nc, ow, nd, tuple(j for j, f in zip(earlier, row) if f), cv))
    ps.tiles = [(bounds[t][0], bounds[t][1], chunks) for t, chunks in tiles]
    return ps


def _plan(pattern: DilatedPattern, a, causal: bool) -> list:
    """All passes for the inputs ``a`` (an ``AttnInputs``); depends on positions only."""
    per_head = pattern.query_dilation == "per_head"
    group_size = a.hq // a.hkv
    qpos, kpos = a.q_positions, a.k_positions  # [Bp, S]
    # Rows with equal positions (e.g. [1, S] expanded to the batch) share one plan; only their
    # document ids (masks) differ.
    shared = torch.equal(qpos, qpos[:1].expand_as(qpos)) and torch.equal(kpos, kpos[:1].expand_as(kpos))
    dev = qpos.device
    passes = []
    for b in ([None] if shared else range(a.batch)):
        rows = slice(None) if b is None else slice(b, b + 1)
        # ([1, S] positions serve every row: q and k may differ in their leading size)
        qp = qpos[0 if b is None or qpos.shape[0] == 1 else b]
        kp = kpos[0 if b is None or kpos.shape[0] == 1 else b]
        qd = kd = None
        if a.q_doc_ids is not None:
            pick = slice(None) if (b is None or a.q_doc_ids.shape[0] == 1) else rows
            qd, kd = a.q_doc_ids[pick], a.k_doc_ids[pick]
        n_rows = a.batch if b is None else 1
        q_all = torch.arange(a.sq, device=dev)
        k_all = torch.arange(a.sk, device=dev)
        work = []  # (config or None, configs before it, heads, query rows, key rows)
        order = priority(pattern)
        for n, i in enumerate(order):
            r = pattern.dilation_rates[i]
            if per_head and r > 1:
                # Head h uses class h % r: one pass per class present among the heads.
                _, qcls = pattern.segment_and_class(i, qp)
                _, kcls = pattern.segment_and_class(i, kp)
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
        for i, earlier, heads, qs, ks in work:
            ps = _make_pass(pattern, i, earlier, rows, heads, a.hq, group_size, qs, qp.index_select(0, qs),
                            None if qd is None else qd.index_select(1, qs), ks,
                            kp.index_select(0, ks),
                            None if kd is None else kd.index_select(1, ks), causal, n_rows)
            if ps is not None:
                passes.append(ps)
    return passes


# Plans depend on positions only: every layer of a forward (and of a decode step) repeats the
# first layer's call, so the plan is made once and reused (``plan_cache``). Key: everything
# ``_plan`` reads besides the position / document-id tensors, and the block sizes (tests
# change them). At most 16 plans (a plan's index tensors are O(S * configs)).
_PASS_CACHE = PlanCache(8, per_key=2)


def _cached_plan(pattern: DilatedPattern, a, causal: bool) -> list:
    """:func:`_plan`, made once per (pattern, positions, document ids, causal, shapes)."""
    key = ("passes", pattern, bool(causal), a.batch, a.hq, a.hkv, a.sq, a.sk, CHUNK_Q, CHUNK_K,
           MAX_BLOCK_ELEMENTS, SLIDING_CQ_MIN, SLIDING_DIV)
    return _PASS_CACHE.get_or_make(key, (a.q_positions, a.k_positions, a.q_doc_ids, a.k_doc_ids),
                                   lambda: _plan(pattern, a, causal))


def _block_mask(pattern, ps, qp, kp, qd, kd, chunk):
    """Mask ``[Bm, Hm, cq, ck]`` (Bm in {1, Bd}, Hm in {1, heads of the pass}) of the pairs of
    this block that pass ``ps`` owns, or ``None`` when every pair is owned."""
    _, _, need_causal, own, need_docs, dedupe, covered = chunk
    qc, kc = qp[:, None], kp[None, :]
    h = ps.head_ids.view(-1, 1, 1)
    mask = None
    if own == _OWN_RULE:
        mask = pattern.config_allowed(ps.config, h, qc, kc)
    if own == _OWN_WINDOW or covered:
        # Sliding windows whose class test holds for every pair: the rule is a distance, with
        # no head dimension. Causal: the signed p - s, as pairs with s > p go anyway (below).
        dist = qc - kc if ps.causal else (qc - kc).abs()
        if own == _OWN_WINDOW:
            m = dist < pattern.segment_lengths[ps.config]
            mask = m if mask is None else mask & m
        if covered:  # the union rule: |p - s| < covered belongs to an earlier config
            m = dist >= covered
            mask = m if mask is None else mask & m
    taken = None  # the union rule: a pair belongs to the first config that allows it
    for j in dedupe:
        t = pattern.config_allowed(j, h, qc, kc)
        taken = t if taken is None else taken | t
    if taken is not None:
        mask = ~taken if mask is None else mask & ~taken
    if need_causal and not (covered and ps.causal):  # p - s >= covered > 0 is causal already
        mask = (kc <= qc) if mask is None else mask & (kc <= qc)
    if mask is not None:
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if need_docs:  # same document only; a negative key id is padding
        d = ((qd[:, :, None] == kd[:, None, :]) & (kd[:, None, :] >= 0))[:, None]
        mask = d if mask is None else mask & d
    return mask


def _grouped_mask(mask, hk, g):
    """``[Bm, Hm, cq, ck]`` -> broadcastable to scores viewed as ``[B, hk, g, cq, ck]``."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], hk, g, mask.shape[2], mask.shape[3])


def _pass_views(ps, hkv):
    """Per-pass head layout ``(hk, g)``: scores are ``[B, hk, g * cq, ck]``. All heads: the
    grouped view (hk = Hkv, g = Hq // Hkv); a subset of heads: one row block per head."""
    hc = ps.head_ids.numel()
    return (hkv, hc // hkv) if ps.kv_ids is None else (hc, 1)


def _gather_kv(t, rows, idx, kv_ids):
    """``t[rows][:, kv heads][:, :, idx]`` as ``[B', hk, n, D]``: only the block is copied."""
    blk = t[rows].index_select(2, idx)
    return blk if kv_ids is None else blk.index_select(1, kv_ids)


def _key_chunk(ps, kf, vf, chunk):
    """Storage rows ``ki`` of a key chunk and its K and V blocks ``[B', hk, ck, D]``."""
    ki = ps.k_order[chunk[0]:chunk[1]]
    return ki, _gather_kv(kf, ps.rows, ki, ps.kv_ids), _gather_kv(vf, ps.rows, ki, ps.kv_ids)


def _mask_scores(s, pattern, ps, chunk, qp, qd, hk, g):
    """Scores ``s`` ``[B', hk, g*cq, ck]`` with the pairs the pattern forbids set to -inf
    (unchanged when the whole block is allowed)."""
    k_lo, k_hi = chunk[0], chunk[1]
    kd = None if ps.k_doc is None else ps.k_doc[:, k_lo:k_hi]
    mask = _block_mask(pattern, ps, qp, ps.k_pos[k_lo:k_hi], qd, kd, chunk)
    if mask is None:
        return s
    s5 = s.view(s.shape[0], hk, g, -1, s.shape[-1])
    return torch.where(_grouped_mask(mask, hk, g), s5, float("-inf")).view_as(s)


def _chunked_forward(pattern, passes, qf, kf, vf):
    """Forward over the plan: ``out [B, Hq, Sq, Dv]`` and ``lse [B, Hq, Sq]`` in qf's dtype.
    ``qf`` is already multiplied by the softmax scale."""
    b, hq, sq, _ = qf.shape
    dv = vf.shape[-1]
    out = qf.new_zeros(b, hq, sq, dv)
    lse = qf.new_full((b, hq, sq), float("-inf"))
    for ps in passes:
        hk, g = _pass_views(ps, kf.shape[1])
        q_src = qf[ps.rows, ps.heads]
        out_v, lse_v = out[ps.rows, ps.heads], lse[ps.rows, ps.heads]
        for lo, hi, chunks in ps.tiles:
            qi = ps.q_order[lo:hi]
            cq = qi.numel()
            qb = q_src.index_select(2, qi)  # [B', Hc, cq, D]
            nb = qb.shape[0]
            qb = qb.reshape(nb, hk, g * cq, qb.shape[-1])
            m = qb.new_full((nb, hk, g * cq), float("-inf"))
            l = qb.new_zeros(nb, hk, g * cq)
            acc = qb.new_zeros(nb, hk, g * cq, dv)
            qp = ps.q_pos[lo:hi]
            qd = None if ps.q_doc is None else ps.q_doc[:, lo:hi]
            for chunk in chunks:
                ki, kb, vb = _key_chunk(ps, kf, vf, chunk)
                s = torch.matmul(qb, kb.transpose(-1, -2))  # [B', hk, g*cq, ck]
                s = _mask_scores(s, pattern, ps, chunk, qp, qd, hk, g)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = finite_or_zero(m_new)  # empty rows stay 0
                p = s.sub_(m_safe[..., None]).exp_()
                corr = torch.exp(m - m_safe)
                # A ones column on V makes the row sums of p come out of the same matmul.
                pv = torch.matmul(p, torch.cat([vb, vb.new_ones(vb.shape[:-1] + (1,))], -1))
                l = l * corr + pv[..., -1]
                acc = acc * corr[..., None] + pv[..., :-1]
                m = m_new
            # Tile result (lse_t, out_t), merged into the running (lse, out) of these queries.
            lse_t = (m + torch.log(l)).view(nb, hk * g, cq)  # -inf where nothing was allowed
            out_t = (acc / l.clamp_min(torch.finfo(l.dtype).tiny)[..., None]).view(nb, hk * g, cq, dv)
            l0 = lse_v.index_select(2, qi)
            o0 = out_v.index_select(2, qi)
            o, new = merge_partials(o0, l0, out_t, lse_t)
            lse_v.index_copy_(2, qi, new)
            out_v.index_copy_(2, qi, o)
    return out, lse


def _chunked_backward(pattern, passes, qf, kf, vf, dout, lse, delta, scale):
    """FlashAttention-style backward: probabilities recomputed block by block from ``lse``;
    ``delta = rowsum(dO * O) - dlse``. ``qf`` is scaled. Returns dq, dk, dv (qf's dtype)."""
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    hkv = kf.shape[1]
    lse_safe = finite_or_zero(lse)  # rows with no key: p = 0 anyway
    for ps in passes:
        hk, g = _pass_views(ps, hkv)
        q_src = qf[ps.rows, ps.heads]
        do_src = dout[ps.rows, ps.heads]
        lse_src, delta_src = lse_safe[ps.rows, ps.heads], delta[ps.rows, ps.heads]
        dq_v, dk_v, dv_v = dq[ps.rows, ps.heads], dk[ps.rows], dv[ps.rows]
        for lo, hi, chunks in ps.tiles:
            qi = ps.q_order[lo:hi]
            cq = qi.numel()
            qb = q_src.index_select(2, qi)
            nb = qb.shape[0]
            qb = qb.reshape(nb, hk, g * cq, qb.shape[-1])
            dob = do_src.index_select(2, qi).reshape(nb, hk, g * cq, -1)
            lse_b = lse_src.index_select(2, qi).reshape(nb, hk, g * cq, 1)
            delta_b = delta_src.index_select(2, qi).reshape(nb, hk, g * cq, 1)
            dq_t = torch.zeros_like(qb)
            qp = ps.q_pos[lo:hi]
            qd = None if ps.q_doc is None else ps.q_doc[:, lo:hi]
            for chunk in chunks:
                ki, kb, vb = _key_chunk(ps, kf, vf, chunk)
                s = torch.matmul(qb, kb.transpose(-1, -2)).sub_(lse_b)
                s = _mask_scores(s, pattern, ps, chunk, qp, qd, hk, g)
                p = s.exp_()  # [B', hk, g*cq, ck]
                dv_b = torch.matmul(p.transpose(-1, -2), dob)  # [B', hk, ck, Dv]
                ds = torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta_b).mul_(p)
                dq_t += torch.matmul(ds, kb)
                dk_b = torch.matmul(ds.transpose(-1, -2), qb)  # q is scaled: d(s)/dk = scale*q
                if ps.kv_ids is not None:  # fold the pass's heads onto their key/value heads
                    dk_b = dk_b.new_zeros(nb, hkv, *dk_b.shape[2:]).index_add_(1, ps.kv_ids, dk_b)
                    dv_b = dv_b.new_zeros(nb, hkv, *dv_b.shape[2:]).index_add_(1, ps.kv_ids, dv_b)
                dk_v.index_add_(2, ki, dk_b)
                dv_v.index_add_(2, ki, dv_b)
            dq_v.index_add_(2, qi, dq_t.view(nb, hk * g, cq, -1))
    return dq * scale, dk, dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pattern, passes, scale):
        cdt = accum_dtype(q.dtype)
        qf = q.to(cdt) * scale
        out, lse = _chunked_forward(pattern, passes, qf, k.to(cdt), v.to(cdt))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern, ctx.passes, ctx.scale = pattern, passes, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # computes in its own dtype even when backward() runs inside torch.autocast
        with torch.autocast(dout.device.type, enabled=False):
            return _ChunkedAttention._backward(ctx, dout, dlse)

    @staticmethod
    def _backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cdt = lse.dtype
        dout = dout.to(cdt)
        delta = (dout * out.to(cdt)).sum(-1)  # [B, Hq, Sq]
        if dlse is not None:
            delta = delta - dlse.to(cdt)  # d lse / d s = p: folds into the same ds formula
        dq, dk, dv = _chunked_backward(ctx.pattern, ctx.passes, q.to(cdt) * ctx.scale, k.to(cdt),
                                       v.to(cdt), dout, lse, delta, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# --------------------------------------------------------------------------------------------
# Dense tiles for PyTorch's fused CPU attention (the kernel SDPA runs on CPU). Causal
# self-attention at positions 0..S-1 (a model's prefill and training step; packed documents
# and padding: one such call per document, ``_document_runs``) is planned once per (pattern,
# length, heads) as batched calls of that kernel, each over dense tiles
# in the *class coordinates* of a config: the tokens ``c, c + r, c + 2r, ...`` of one segment
# (or of the whole sequence, sliding windows). A unit is a (query head, class) pair: per_head,
# head h and class h % r; in "all" mode every head with every class; a rate-1 config keeps all
# heads in one tile (grouped-query layout, no per-head copies of K/V).
#
# - segment config with no earlier config: one causal square per (unit, segment);
# - segment config whose earlier configs cover whole blocks (their rates divide r_i, their
#   segments divide w_i and are multiples of r_i): the union leaves a block staircase, query
#   block b against the keys of blocks < b, as unmasked rectangles;
# - any other segment config: query blocks of FAST_QUERY_BLOCK against the keys up to the
#   block, with a boolean mask (causality and the union rule, ``DilatedPattern.config_allowed``);
# - sliding config whose earlier configs all have rates dividing r_i: within a class the pair
#   set is the band ``a <= t_p - t_s < b`` (a = ceil(cov / r), b = ceil(w_i / r), cov the
#   largest earlier window), cut into blocks of width b - a: each block against itself
#   (causal) and against the block before it, which, both orders reversed, is causal too;
# - sink tokens: every query against keys 0..k-1 with the union rule's mask, in plain matmuls.
# Tiles padded to equal length read any valid row (causality or the mask hides a padded key;
# a padded query writes to a dummy row S). Several tiles meet a query; their (out, lse) are
# merged. The backward calls the kernel's own backward per tile with the merged (out, lse),
# which is the gradient of the union; padded queries get lse = +inf there (p = 0). A gradient
# of lse is folded in through one extra feature column (dout 1, out -dlse, zeros in q, k, v):
# the kernel's delta = rowsum(dout * out) becomes rowsum(dout * out) - dlse. Anything else
# (other positions, non-causal, other sliding patterns, other devices) takes the blockwise
# path above. Measured against SDPA in docs/decisions.md, "CPU fallback".
# --------------------------------------------------------------------------------------------

_FLASH_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                     None)
FAST_QUERY_BLOCK = 512  # masked tiles: queries per tile
_PLAN_CACHE: dict = {}
_PLAN_CACHE_SIZE = 64
MAX_DOCUMENT_RUNS = 1024  # packed documents: beyond this many calls, the blockwise path


class _Tiles:
    """One fused-kernel call over ``n`` problems of ``lq`` queries and ``lk`` keys, each with
    every head (``grouped``, rows in (problem, head, token) order) or with one.

    ``qr`` indexes the rows of q ``[Hq * S]``, ``kr`` of k ``[Hkv * S]``, ``qw`` of the output
    ``[Hq * (S + 1)]`` (row S of a head: the dummy a padded query writes to); ``q_range`` /
    ``k_range``: the positions ``(lo, hi)`` of a grouped tile over one range (read and written
    as views). ``mask`` ``[n, lq, lk]`` bool or None; ``empty`` ``[n * lq]`` rows without an
    allowed key, or None; ``first``: no earlier tile wrote these rows (``mixed``: some)."""

    __slots__ = ("n", "lq", "lk", "grouped", "qr", "kr", "qw", "causal", "mask", "empty",
                 "first", "mixed", "q_range", "k_range")


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
        qt, kt = qt[keep], kt[keep]
        qh = None if qh is None else qh[keep]
        mask = None if mask is None else mask[keep]
    if qt.shape[0] == 0 or qt.shape[1] == 0 or kt.shape[1] == 0:
        return None
    t = _Tiles()
    t.n, t.lq, t.lk, t.causal, t.mask = qt.shape[0], qt.shape[1], kt.shape[1], causal, mask
    t.grouped = qh is None
    qc, kc = qt.clamp_max(s - 1), kt.clamp_max(s - 1)
    t.q_range = t.k_range = None
    if t.grouped:  # rows ordered (problem, head, token): a gather is the kernel's layout
        t.q_range, t.k_range = _as_range(qt.flatten(), s), _as_range(kt.flatten(), s)
        hs, ks = torch.arange(hq).view(1, -1, 1), torch.arange(hkv).view(1, -1, 1)
        t.qr = (hs * s + qc[:, None]).flatten()
        t.kr = (ks * s + kc[:, None]).flatten()
        t.qw = (hs * (s + 1) + qt[:, None]).flatten()
        seen = touched[:, qt[qt < s]]
        touched[:, qt.flatten()] = True
    else:
        kh = torch.div(qh, hq // hkv, rounding_mode="floor")
        t.qr = (qh[:, None] * s + qc).flatten()
        t.kr = (kh[:, None] * s + kc).flatten()
        t.qw = (qh[:, None] * (s + 1) + qt).flatten()
        flat = touched.view(-1)
        seen = flat[t.qw[qt.flatten() < s]]
        flat[t.qw] = True
    # first: no row written before (the kernel's result is copied in); otherwise the rows are
    # merged, and where only some were written the plan initialises the accumulators
    t.first = not bool(seen.any())
    t.mixed = not (t.first or bool(seen.all()))
    t.empty = None
    if mask is not None:
        empty = ~mask.any(-1)
        t.empty = empty.flatten() if bool(empty.any()) else None
    return t


def _as_range(rows, s):
    """``(lo, hi)`` when ``rows`` is ``lo, lo + 1, ..., hi - 1`` with ``hi <= s``, else None."""
    lo, hi = int(rows[0]), int(rows[0]) + rows.numel()
    return (lo, hi) if hi <= s and torch.equal(rows, torch.arange(lo, hi)) else None


def _units(pattern, i, hq):
    """(query head, class) pairs of config ``i``: two ``[U]`` tensors."""
    r = pattern.dilation_rates[i]
    h = torch.arange(hq)
    if pattern.query_dilation == "per_head" or r == 1:
        return h, h % r
    return h.repeat_interleave(r), torch.arange(r).repeat(hq)


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
    uh, uc = _units(pattern, i, hq)
    # each earlier config owns exactly the pairs of our class inside one of its segments
    nested = all(class_uniform(cfg, r, False) and nests(cfg[0], w, r) for cfg in earlier)
    if nested and earlier:
        big = max(wj for wj, _ in earlier)
        nested = all(big % wj == 0 for wj, _ in earlier)
    grouped = r == 1 and (nested or not earlier)
    if grouped:
        uh, uc = uh[:1], uc[:1]
    out = []
    full, rest = divmod(s, w)
    sets = [(torch.arange(full) * w, w)] if full else []
    if rest:
        sets.append((torch.tensor([full * w]), rest))
    for starts, seg_len in sets:
        length = -(-seg_len // r)  # tokens of class 0, the longest class
        c, start = uc.view(-1, 1, 1), starts.view(1, -1, 1)
        h = None if grouped else uh.view(-1, 1).expand(-1, starts.numel()).flatten()

        def rows(t):  # class indices [1, 1, L] -> storage rows [U * G, L] (s: none)
            off = c + r * t
            return torch.where(off < seg_len, start + off, s).flatten(0, 1)

        def add(qt, kt, causal, mask=None):
            out.append(_tiles(s, hq, hkv, h, qt, kt, causal, touched, mask))

        if not earlier:
            t = torch.arange(length).view(1, 1, -1)
            add(rows(t), rows(t), True)
        elif nested:
            m = max(wj for wj, _ in earlier) // r
            for b in range(1, -(-length // m)):
                tq = b * m + torch.arange(min(m, length - b * m)).view(1, 1, -1)
                add(rows(tq), rows(torch.arange(b * m).view(1, 1, -1)), False)
        else:
            hb = uh.view(-1, 1, 1, 1)
            for lo in range(0, length, FAST_QUERY_BLOCK):
                hi = min(lo + FAST_QUERY_BLOCK, length)
                qt = rows(torch.arange(lo, hi).view(1, 1, -1))
                kt = rows(torch.arange(hi).view(1, 1, -1))
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
    uh, uc = _units(pattern, i, hq)
    if r == 1:
        uh, uc = uh[:1], uc[:1]
    n = torch.div(s - uc + (r - 1), r, rounding_mode="floor")  # tokens per class
    m_max = int((n - a).max())
    if b <= a or m_max <= 0:
        return []
    blk = min(b - a, m_max)
    nb = -(-m_max // blk)
    c, nc = uc.view(-1, 1, 1), n.view(-1, 1, 1)

    def rows(t):  # class indices [U, nb', L] -> storage rows [U * nb', L] (s: none)
        return torch.where((t >= 0) & (t < nc), c + r * t, s).flatten(0, 1)

    def heads(nblocks):
        return None if r == 1 else uh.view(-1, 1).expand(-1, nblocks).flatten()

    base = torch.arange(nb).view(1, -1, 1) * blk
    x = torch.arange(blk).view(1, 1, -1)
    tq = (a + base + x).expand(uh.numel(), -1, -1)
    out = [_tiles(s, hq, hkv, heads(nb), rows(tq), rows((base + x).expand_as(tq)), True,
                  touched)]
    if nb > 1 and blk > 1:  # the block before, both orders reversed: causal again
        x, base = x[..., :-1], base[:, 1:]
        tq = (a + base + blk - 2 - x).expand(uh.numel(), -1, -1)
        out.append(_tiles(s, hq, hkv, heads(nb - 1), rows(tq),
                          rows((base - 1 - x).expand_as(tq)), True, touched))
    return out


def _fast_applies(pattern, a, causal, q) -> bool:
    """Whether the dense-tile path can take this call, positions and documents aside."""
    cfgs = [pattern.configs[i] for i in priority(pattern)]
    return (_FLASH_FWD is not None and _FLASH_BWD is not None and q.device.type == "cpu"
            and causal and a.sq == a.sk and a.head_dim_v == a.head_dim
            # sliding: an earlier class test that varied inside a class would need masks per pair
            and not (pattern.sliding and not all(class_uniform(e, r, True) for n, (_, r)
                                                 in enumerate(cfgs) for e in cfgs[:n])))


def _fast_plan(pattern, a, causal, q):
    """The dense-tile plan for this call, or None when the fast path does not apply."""
    if not _fast_applies(pattern, a, causal, q) or a.q_doc_ids is not None:
        return None
    if not a.natural_positions:
        ar = torch.arange(a.sq)
        if not (torch.equal(a.q_positions.cpu(), ar.expand_as(a.q_positions))
                and torch.equal(a.k_positions.cpu(), ar.expand_as(a.k_positions))):
            return None
    return _natural_plan(pattern, a.sq, a.hq, a.hkv)


def _natural_plan(pattern, s, hq, hkv):
    """The dense-tile plan of causal self-attention at positions 0..s-1 (cached)."""
    key = (pattern, s, hq, hkv, FAST_QUERY_BLOCK)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        return plan
    touched = torch.zeros(hq, s + 1, dtype=torch.bool)
    make = _sliding_tiles if pattern.sliding else _segment_tiles
    plan = _FastPlan()
    order = priority(pattern)
    plan.tiles = [t for n, i in enumerate(order)
                  for t in make(pattern, i, order[:n], s, hq, hkv, touched) if t is not None]
    plan.init = any(t.mixed for t in plan.tiles)
    plan.sink_mask, plan.sink_lo = None, s
    if pattern.sink_tokens:
        h = torch.arange(hq).view(-1, 1, 1)
        qp, kp = torch.arange(s).view(1, -1, 1), torch.arange(min(pattern.sink_tokens, s))
        kp = kp.view(1, 1, -1)
        mask = (kp <= qp).expand(hq, -1, -1).clone()
        for j in range(pattern.num_configs):
            mask &= ~pattern.config_allowed(j, h, qp, kp)
        rows = mask.any(2).any(0).nonzero()
        plan.sink_lo = int(rows[0]) if rows.numel() else s
        plan.sink_mask = mask[:, plan.sink_lo:].contiguous() if rows.numel() else None
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[key] = plan
    return plan


def _document_runs(pattern, a, causal, q):
    """Packed or padded self-attention as ``[(row, lo, hi)]``: storage ranges each holding one
    whole document at positions 0..hi-lo-1 (padding, doc id < 0, left out: those queries
    attend nothing), each a call of the dense-tile path; None for any other layout."""
    if a.q_doc_ids is None or not _fast_applies(pattern, a, causal, q):
        return None
    ranges = document_ranges(a)
    if ranges is None or len(ranges) > MAX_DOCUMENT_RUNS or any(p0 for *_, p0 in ranges):
        return None  # a split document, a continuation, or too many calls
    return [(b, lo, hi) for b, lo, hi, _ in ranges]


def _fast_documents(q, k, v, pattern, a, runs):
    """``(out, lse)`` of the document ``runs``, one dense-tile call each, assembled along the
    sequence (zeros and -inf between them)."""
    acc = accum_dtype(q.dtype)
    rows = []
    for b in range(a.batch):
        outs, lses, at = [], [], 0
        for _, lo, hi in (r for r in runs if r[0] == b):
            if lo > at:
                outs.append(q.new_zeros(1, a.hq, lo - at, v.shape[-1]))
                lses.append(q.new_full((1, a.hq, lo - at), float("-inf"), dtype=acc))
            sl = (slice(b, b + 1), slice(None), slice(lo, hi))
            o, l = _FastAttention.apply(q[sl], k[sl], v[sl],
                                        _natural_plan(pattern, hi - lo, a.hq, a.hkv), a.scale)
            outs.append(o)
            lses.append(l)
            at = hi
        if at < a.sq:
            outs.append(q.new_zeros(1, a.hq, a.sq - at, v.shape[-1]))
            lses.append(q.new_full((1, a.hq, a.sq - at), float("-inf"), dtype=acc))
        rows.append((torch.cat(outs, 2), torch.cat(lses, 2)))
    return torch.cat([o for o, _ in rows]), torch.cat([l for _, l in rows])


def _float_mask(t, b, dtype):
    if t.mask is None:
        return None
    m = torch.zeros(t.mask.shape, dtype=dtype).masked_fill_(~t.mask, float("-inf"))
    m = m.unsqueeze(1)  # [n, 1, lq, lk]
    return m if b == 1 else m.repeat(b, 1, 1, 1)


def _gather(t, x, xf, b, rows, length, rng=None):
    """The tile's rows of ``x`` ``[B, H, S, D]`` (``xf``: ``[B, H * S, D]``; ``rows`` index
    it) as the kernel's ``[B * n, H or 1, length, D]``; a grouped tile over the range ``rng``
    of positions is a view (a copy only for B > 1 with several segments)."""
    if rng is not None:
        h, d = x.shape[1], x.shape[-1]
        return x[:, :, rng[0]:rng[1]].view(b, h, t.n, length, d).transpose(1, 2).reshape(
            b * t.n, h, length, d)
    return xf.index_select(1, rows).view(b * t.n, -1, length, xf.shape[-1])


def _merge_into(o_t, l_t, o, l):
    """``(o_t, l_t)`` <- the merge of ``(o_t, l_t)`` and ``(o, l)`` (two partial results over
    disjoint keys), in place."""
    new = torch.logaddexp(l_t, l)
    ref = finite_or_zero(new)
    o_t.mul_(torch.exp(l_t - ref).unsqueeze(-1)).addcmul_(o, torch.exp(l - ref).unsqueeze(-1))
    l_t.copy_(new)


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
            _merge_into(o_t, l_t, o, l)
        return
    o_all, l_all = out.view(b, -1, out.shape[-1]), lse.view(b, -1)
    o, l = o.reshape(b, -1, o.shape[-1]), l.reshape(b, -1)
    if not t.first:
        o_t, l_t = o_all.index_select(1, t.qw), l_all.index_select(1, t.qw)
        _merge_into(o_t, l_t, o, l)
        o, l = o_t, l_t
    o_all.index_copy_(1, t.qw, o)
    l_all.index_copy_(1, t.qw, l)


def _sink_scores(q, k, mask, scale, acc):
    """Scaled scores of every query against the sink keys, forbidden pairs at -inf:
    ``[B, Hq, S, k]`` in ``acc``, and the sink keys ``[B, Hq, k, D]``."""
    g = q.shape[1] // k.shape[1]
    ks = k[:, :, :mask.shape[-1]].to(acc).repeat_interleave(g, 1)
    sc = torch.matmul(q.to(acc), ks.transpose(-1, -2)) * scale
    return sc.masked_fill(~mask, float("-inf")), ks


def _fast_forward(plan, q, k, v, scale):
    """``(out, lse)`` ``[B, Hq, S, D]`` / ``[B, Hq, S]`` in the accumulation dtype."""
    b, hq, s, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    acc = accum_dtype(q.dtype)
    t = plan.tiles[0] if len(plan.tiles) == 1 else None
    if t is not None and t.grouped and t.n == 1 and t.q_range == t.k_range == (0, s):
        # one causal call over the whole sequence (dense up to the first window): as SDPA
        out, lse = _FLASH_FWD(q, k, v, 0.0, True, scale=scale)
        out, lse = out.to(acc), lse.to(acc)
        if plan.sink_mask is not None:
            _merge_sinks(plan, q, k, v, out, lse, scale, acc)
        return out, lse
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    qf, kf, vf = q.view(b, hq * s, d), k.view(b, hkv * s, d), v.view(b, hkv * s, dv)
    if plan.init:
        out = q.new_zeros(b, hq, s + 1, dv, dtype=acc)
        lse = q.new_full((b, hq, s + 1), float("-inf"), dtype=acc)
    else:  # every row is first written whole by one tile
        out = q.new_empty(b, hq, s + 1, dv, dtype=acc)
        lse = q.new_empty((b, hq, s + 1), dtype=acc)
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
        _merge_sinks(plan, q, k, v, out, lse, scale, acc)
    return out, lse


def _merge_sinks(plan, q, k, v, out, lse, scale, acc):
    """Merge the sink keys' part (every query against keys 0..k-1, the union rule's mask) into
    ``(out, lse)`` in place."""
    lo = plan.sink_lo
    sc, _ = _sink_scores(q[:, :, lo:], k, plan.sink_mask, scale, acc)
    ls = torch.logsumexp(sc, -1)
    p = torch.exp(sc - finite_or_zero(ls)[..., None])
    vs = v[:, :, :sc.shape[-1]].to(acc).repeat_interleave(q.shape[1] // k.shape[1], 1)
    _merge_into(out[:, :, lo:], lse[:, :, lo:], torch.matmul(p, vs), ls)


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
    lse_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    t = plan.tiles[0] if len(plan.tiles) == 1 else None
    whole = t is not None and t.grouped and t.n == 1 and t.q_range == t.k_range == (0, s) \
        and dlse is None  # one causal call over the whole sequence, as SDPA
    if whole and plan.sink_mask is None:
        return _FLASH_BWD(dout, q, k, v, out, lse_acc.to(lse_dt), 0.0, True, scale=scale)
    dq = q.new_zeros(b, hq, s + 1, d, dtype=acc)
    dk = k.new_zeros(b, hkv, s, d, dtype=acc)
    dv = v.new_zeros(b, hkv, s, dv_, dtype=acc)
    if plan.sink_mask is not None:  # FlashAttention's formulas on the few sink keys
        lo = plan.sink_lo  # the queries from lo on
        sc, ks = _sink_scores(q[:, :, lo:], k, plan.sink_mask, scale, acc)
        p = torch.exp(sc - lse_acc[:, :, lo:, None])
        n_s, g = sc.shape[-1], hq // hkv
        vs = v[:, :, :n_s].to(acc).repeat_interleave(g, 1)
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
        gq, gk, gv = _FLASH_BWD(dout, q, k, v, out, lse_acc.to(lse_dt), 0.0, True, scale=scale)
        dq[:, :, :s] += gq
        return dq[:, :, :s], dk + gk, dv + gv
    if dlse is not None:  # the extra column: delta = rowsum(dout * out) - dlse
        def col(x, value):
            return torch.cat([x, torch.broadcast_to(torch.as_tensor(value, dtype=x.dtype),
                                                    x.shape[:-1] + (1,))], -1)
        q, k, v = col(q, 0.0), col(k, 0.0), col(v, 0.0)
        dout, out = col(dout, 1.0), col(out, (-dlse).to(out.dtype)[..., None])
    q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
    qf, kf, vf = (x.view(b, -1, x.shape[-1]) for x in (q, k, v))
    dof, of = dout.view(b, hq * s, -1), out.view(b, hq * s, -1)
    # row S: lse +inf, so a padded query takes no part (p = 0)
    lr = torch.cat([lse_acc.to(lse_dt), lse_acc.new_full((b, hq, 1), float("inf"), dtype=lse_dt)],
                   2).unsqueeze(-1)
    lrf = lr.view(b, -1, 1)
    for t in plan.tiles:
        qs = (t.qw, t.lq, t.q_range)
        ks = (t.kr, t.lk, t.k_range)
        gq, gk, gv = _FLASH_BWD(_gather(t, dout, dof, b, t.qr, t.lq, t.q_range),
                                _gather(t, q, qf, b, t.qr, t.lq, t.q_range),
                                _gather(t, k, kf, b, *ks), _gather(t, v, vf, b, *ks),
                                _gather(t, out, of, b, t.qr, t.lq, t.q_range),
                                _gather(t, lr, lrf, b, *qs).squeeze(-1), 0.0, t.causal,
                                attn_mask=_float_mask(t, b, q.dtype), scale=scale)
        _add(t, dq, gq[..., :d].to(acc), b, *qs)
        _add(t, dk, gk[..., :d].to(acc), b, *ks)
        _add(t, dv, gv[..., :dv_].to(acc), b, *ks)
    return dq[:, :, :s], dk, dv


class _FastAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        # float16/bfloat16 run in float32, as in the blockwise path: lse stays float32-exact
        ctx.set_materialize_grads(False)
        cdt = accum_dtype(q.dtype)
        out, lse = _fast_forward(plan, q.to(cdt), k.to(cdt), v.to(cdt), scale)
        ctx.save_for_backward(q, k, v, out, lse)
        out = out.to(q.dtype)
        ctx.plan, ctx.scale = plan, scale
        return out, lse

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


# --------------------------------------------------------------------------------------------
# Few queries against many keys (decoding: one query per step, at any context): one call of
# the fused CPU kernel over every key, with the pattern's boolean mask
# (``DilatedPattern.build_mask``) as an additive float mask: SDPA's work plus a mask add. The
# mask is made once per (pattern, positions, document ids) and reused by every layer of the
# step (``plan_cache``). It reads every key, where the blockwise path reads about
# sum_i min(w_i, Sk) / r_i of them per query but plans (sorts, searches, gathers per config and
# class) once per step: the fused call is taken while Sk is at most FEW_QUERIES_KEY_RATIO times
# that sum. Measured on CPU, one thread, the default pattern, heads of 64 (a shared machine:
# single timings vary by +-30 % and more): per layer with the plan reused, 8K keys (Sk 1.0x the
# sum), 4 / 32 query heads: fused 0.4 / 13.5 ms, blockwise 2.1 / 41 ms; 16K (1.7x): 2.3 / 25
# vs 2.2 / 32 ms (another run: 2.1 / 45 vs 1.9 / 17), and a whole 4-layer decode step
# (examples/benchmarks/decode_cpu.py) 1.23x SDPA fused vs 1.66x blockwise; 32K (2.9x): 11 / 61
# vs 2.1 / 24 ms. The backward recomputes the probabilities from lse in plain matmuls (as
# small as the mask: FEW_QUERIES_MAX_ELEMENTS).
# --------------------------------------------------------------------------------------------

FEW_QUERIES_MAX = 16  # queries per call (decode, speculative decode); more: the blockwise plan
FEW_QUERIES_KEY_RATIO = 2.0
FEW_QUERIES_MAX_ELEMENTS = 1 << 23  # B * Hq * Sq * Sk: the float mask's size
_MASK_CACHE = PlanCache(4, per_key=1)  # a step's mask; at most 4 (each <= 32 MB)


class _MaskPlan:
    """``mask`` ``[Bm, Hq, Sq, Sk]`` additive (0 / -inf) in the compute dtype (Bm in {1, B});
    ``empty`` ``[Bm, Hq, Sq]`` the queries with no allowed key, or None."""

    __slots__ = ("mask", "empty")


def _few_queries_apply(pattern, a, q) -> bool:
    """Whether the fused masked call takes this call (see the comment above)."""
    if not (_FLASH_FWD is not None and q.device.type == "cpu" and a.sq <= FEW_QUERIES_MAX
            and a.head_dim_v == a.head_dim
            and a.batch * a.hq * a.sq * a.sk <= FEW_QUERIES_MAX_ELEMENTS):
        return False
    read = sum(min(w, a.sk) // r for w, r in pattern.configs) + pattern.sink_tokens
    return a.sk <= FEW_QUERIES_KEY_RATIO * read


def _few_queries_plan(pattern, a, causal, dtype) -> _MaskPlan:
    """The additive mask of this call (cached: every layer of a step asks for the same)."""
    cdt = accum_dtype(dtype)

    def make():
        allowed = pattern.build_mask(a.hq, a.q_positions, a.k_positions, causal=causal,
                                     q_doc_ids=a.q_doc_ids, k_doc_ids=a.k_doc_ids,
                                     num_kv_heads=a.hkv)
        plan = _MaskPlan()
        plan.mask = torch.zeros(allowed.shape, dtype=cdt, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))
        empty = ~allowed.any(-1)
        plan.empty = empty if bool(empty.any()) else None
        return plan

    key = ("mask", pattern, bool(causal), a.batch, a.hq, a.hkv, a.sq, a.sk, cdt)
    return _MASK_CACHE.get_or_make(key, (a.q_positions, a.k_positions, a.q_doc_ids,
                                         a.k_doc_ids), make)


def _few_queries_forward(q, k, v, plan, scale):
    """``(out, lse)`` of the fused masked call, both in the accumulation dtype."""
    cdt = accum_dtype(q.dtype)
    out, lse = _FLASH_FWD(q.to(cdt), k.to(cdt), v.to(cdt), 0.0, False, attn_mask=plan.mask,
                          scale=scale)
    out, lse = out.to(cdt), lse.to(cdt)
    if plan.empty is not None:  # the kernel gives lse 0 (and out 0) to a row with no key
        lse = lse.masked_fill(plan.empty, float("-inf"))
    return out, lse


def _few_queries(q, k, v, plan, scale):
    """``(out in q.dtype, lse)``; without a gradient to record (decoding), no autograd
    Function around it (its bookkeeping is a tenth of a short call)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FewQueriesAttention.apply(q, k, v, plan, scale)
    out, lse = _few_queries_forward(q, k, v, plan, scale)
    return out.to(q.dtype), lse


class _FewQueriesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        ctx.set_materialize_grads(False)
        out, lse = _few_queries_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None
        with torch.autocast(q.device.type, enabled=False):
            cdt = lse.dtype
            b, hq, sq, d = q.shape
            hkv, sk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
            rows = (hq // hkv) * sq  # grouped view: query head h = kv head * G + g
            qg, kc, vc = q.to(cdt).reshape(b, hkv, rows, d), k.to(cdt), v.to(cdt)
            mask = ctx.plan.mask.reshape(-1, hkv, rows, sk)
            s = torch.matmul(qg, kc.transpose(-1, -2)).mul_(ctx.scale).add_(mask)
            p = s.sub_(finite_or_zero(lse).reshape(b, hkv, rows, 1)).exp_()  # 0: masked, empty
            do = (torch.zeros_like(out) if dout is None else dout.to(cdt)).reshape(
                b, hkv, rows, dv_)
            delta = (do * out.reshape(b, hkv, rows, dv_)).sum(-1, keepdim=True)
            if dlse is not None:
                delta = delta - dlse.to(cdt).reshape(b, hkv, rows, 1)
            dv = torch.matmul(p.transpose(-1, -2), do)
            ds = torch.matmul(do, vc.transpose(-1, -2)).sub_(delta).mul_(p)
            dq = torch.matmul(ds, kc).mul_(ctx.scale).reshape(b, hq, sq, d)
            dk = torch.matmul(ds.transpose(-1, -2), qg).mul_(ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def chunked_attention(q, k, v, pattern, a, *, causal=True):
    """Memory-efficient dilated attention in PyTorch (any device), differentiable.

    Computes exactly what :func:`reference_attention` computes, in float32 (float64 for float64
    inputs), without ever materialising ``[Sq, Sk]``: blocks of at most ``CHUNK_Q x CHUNK_K``
    scores (per batch row and head) planned in position space, with FlashAttention-style
    recomputation in the backward. Sliding windows visit only the keys within each query
    tile's windows, and sink tokens are one pass of every query against the first
    ``sink_tokens`` positions.

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` / ``[B, Hkv, Sk, Dv]``, read in place for GQA.
        pattern: the :class:`DilatedPattern`.
        a: the ``AttnInputs`` from ``check_inputs`` (scale, positions, document ids).
        causal: mask keys at later positions.

    Returns:
        ``(out, lse)``: ``out`` ``[B, Hq, Sq, Dv]`` in ``q.dtype``; ``lse`` ``[B, Hq, Sq]`` in
        float32, float64 for float64 inputs (natural log; ``-inf`` and ``out = 0`` for a query with no allowed key).
    """
    b, hq, sq, _ = q.shape
    if b == 0 or sq == 0 or k.shape[2] == 0:  # nothing to attend: empty / all -inf rows
        out = q.new_zeros(b, hq, sq, v.shape[-1]) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
        return out, q.new_full((b, hq, sq), float("-inf"), dtype=accum_dtype(q.dtype))
    plan = _fast_plan(pattern, a, causal, q)
    if plan is not None:
        return _FastAttention.apply(q, k, v, plan, a.scale)
    if _few_queries_apply(pattern, a, q):
        return _few_queries(q, k, v, _few_queries_plan(pattern, a, causal, q.dtype), a.scale)
    runs = _document_runs(pattern, a, causal, q)
    if runs:
        return _fast_documents(q, k, v, pattern, a, runs)
    passes = _cached_plan(pattern, a, causal)
    out, lse = _ChunkedAttention.apply(q, k, v, pattern, passes, a.scale)
    return out, lse
