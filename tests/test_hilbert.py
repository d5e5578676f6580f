"""Hilbert layout (docs/hilbert.md): the curve, the permutation, and invariance of the attention."""

import math

import pytest
import torch

from conftest import attention_tol
from helpers import assert_close
from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn import hilbert as hmod
from hf_hilbert_attn.hilbert import (
    from_storage,
    hilbert_curve,
    hilbert_permutation,
    resolve_ordering,
    storage_ordering,
    to_storage,
)

PRIMES = (2, 3, 5, 7, 11, 13, 31, 97, 101)
EXTRA_SHAPES = (
    [(1, n) for n in (1, 2, 7, 64, 1000)]
    + [(n, 1) for n in (2, 7, 64, 1000)]
    + [(p, q) for p in PRIMES for q in PRIMES]
    + [(2731, 12), (12, 2731), (2048, 16), (181, 181), (128, 128), (3, 1024), (1025, 2), (2, 1025)]
)


def _rc(rows, cols):
    cur = hilbert_curve(rows, cols)
    return cur, cur // cols, cur % cols


def _check_curve(rows, cols):
    cur, r, c = _rc(rows, cols)
    n = rows * cols
    assert cur.dtype == torch.int64 and cur.shape == (n,), (rows, cols)
    assert torch.equal(torch.sort(cur).values, torch.arange(n)), f"not a bijection: {rows}x{cols}"
    assert int(cur[0]) == 0
    if n > 1:
        steps = (r.diff().abs() + c.diff().abs())
        bad = torch.nonzero(steps != 1).flatten()
        assert bad.numel() == 0, (
            f"{rows}x{cols}: non-unit steps after curve indices {bad[:10].tolist()} "
            f"(cells {cur[bad[:10]].tolist()} -> {cur[bad[:10] + 1].tolist()})"
        )


# ---------------------------------------------------------------------------------- the curve
@pytest.mark.parametrize("rows", range(1, 41))
def test_curve_bijection_and_unit_steps_small(rows):
    # Every shape up to 40 x 40: one unit step between consecutive cells, for all parities.
    for cols in range(1, 41):
        _check_curve(rows, cols)


@pytest.mark.parametrize("shape", EXTRA_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_curve_bijection_and_unit_steps_large(shape):
    _check_curve(*shape)


def test_curve_lines_are_identity():
    # 1 x n and n x 1 grids have exactly one unit-step path from cell 0.
    assert torch.equal(hilbert_curve(1, 37), torch.arange(37))
    assert torch.equal(hilbert_curve(37, 1), torch.arange(37))


def _blocks_contiguous(rows, cols, r, c, size):
    # Each aligned size x size block is entered exactly once <=> visited contiguously.
    blk = (r // size) * math.ceil(cols / size) + c // size
    return int((blk.diff() != 0).sum()) == math.ceil(rows / size) * math.ceil(cols / size) - 1


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_curve_is_classic_hilbert_on_pow2_squares(n):
    # The Hilbert curve's defining locality: every aligned 2^j x 2^j block, at every level,
    # is visited as one contiguous run.
    _, r, c = _rc(n, n)
    size = 2
    while size <= n:
        assert _blocks_contiguous(n, n, r, c, size), f"{n}x{n}: a {size}x{size} block is split"
        size *= 2


def test_curve_is_not_a_snake():
    # The block check above can fail: a boustrophedon over 8 x 8 splits its 4 x 4 quadrants.
    n = 8
    rows = torch.arange(n).repeat_interleave(n)
    cols = torch.arange(n).repeat(n)
    cols = torch.where(rows % 2 == 1, n - 1 - cols, cols)
    assert not _blocks_contiguous(n, n, rows, cols, 4)
    _, r, c = _rc(n, n)
    assert _blocks_contiguous(n, n, r, c, 4)
    assert not torch.equal(r * n + c, rows * n + cols)


def _max_window_extent(r, c, length):
    # max over windows of `length` consecutive curve cells of (bbox height + bbox width)
    rw, cw = r.unfold(0, length, 1), c.unfold(0, length, 1)
    ext = (rw.amax(1) - rw.amin(1) + 1) + (cw.amax(1) - cw.amin(1) + 1)
    return int(ext.max())


@pytest.mark.parametrize("shape", [(32, 47), (45, 33), (61, 77), (2731, 12), (12, 2731),
                                   (1366, 24)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_curve_locality_on_rectangles(shape):
    # Any L consecutive cells fit in a box of about 3*sqrt(L) (height + width), as for the
    # classic curve; a row snake on these grids spans a whole row (>= 1 + min(L, cols)).
    rows, cols = shape
    _, r, c = _rc(rows, cols)
    for length in (16, 64):
        bound = 3.5 * math.sqrt(length)
        if min(rows, cols) >= 32:
            assert 1 + min(length, cols) > bound  # the bound excludes a snake
        assert _max_window_extent(r, c, length) <= bound, (shape, length)


def test_corner_to_corner_endpoints():
    # The building block ends on its start's side wherever parity allows (major even or minor
    # odd): that is what lets the parts join with unit steps.
    for major in range(2, 30):
        for minor in range(1, 30):
            if major % 2 == 1 and minor % 2 == 0:
                continue
            uv = hmod._corner_to_corner(major, minor)
            assert uv[0].tolist() == [0, 0] and uv[-1].tolist() == [major - 1, 0], (major, minor)
            assert int((uv.diff(dim=0).abs().sum(1) != 1).sum()) == 0, (major, minor)


def _halvings(*sizes):
    """Every side length the recursion can reach from ``sizes``: closed under cutting ``n`` into
    ``_even_half(n)`` and ``n - _even_half(n)`` (the only cuts; parts swap and reflect, so every
    sub-curve's shape is a pair of these lengths)."""
    seen, todo = set(), list(sizes)
    while todo:
        n = todo.pop()
        if n >= 1 and n not in seen:
            seen.add(n)
            if n > 1:
                half = hmod._even_half(n)
                todo += [half, n - half]
    return seen


def test_curve_cached_and_builds_each_shape_once(monkeypatch):
    # Counts, not seconds (a loaded machine stretches those): the sub-curve builders are cached
    # by shape, so a curve builds each shape once (its body makes <= 3 sub-curve calls for
    # _corner_to_corner, <= 2 for _free_end) from few shapes (pairs of _halvings lengths:
    # 30**2 for 2731x12, 18**2 for 181x181). Uncached, the same recursion makes ~38,000 calls
    # per curve (2731x12: 38,646; 181x181: 37,916): one per block down to 1-cell strips.
    hmod._hilbert_curve_cached.cache_clear()
    hmod._corner_to_corner.cache_clear()
    hmod._free_end.cache_clear()
    calls = {"_corner_to_corner": [], "_free_end": []}
    for name, log in calls.items():
        cached = getattr(hmod, name)  # the bodies call these module globals: count every call
        monkeypatch.setattr(hmod, name, lambda *shape, _f=cached, _log=log: (
            _log.append(shape), _f(*shape))[1])
    curves = {}
    for shape in [(2731, 12),  # 32772 cells: LongNet's w=32768, r=12 grid
                  (181, 181)]:  # 32761 cells, odd square
        for log in calls.values():
            log.clear()
        curves[shape] = hilbert_curve(*shape)
        ctc, fe = set(calls["_corner_to_corner"]), set(calls["_free_end"])
        sides = len(_halvings(*shape))
        assert len(ctc) <= sides ** 2 and len(fe) <= sides ** 2, (shape, len(ctc), len(fe))
        n_calls = sum(map(len, calls.values()))
        assert n_calls <= 1 + 3 * len(ctc) + 2 * len(fe), (shape, n_calls, len(ctc), len(fe))
    # Asked again: the same tensor, and no sub-curve is built or even looked up.
    for log in calls.values():
        log.clear()
    assert all(hilbert_curve(*shape) is curve for shape, curve in curves.items())
    assert calls == {"_corner_to_corner": [], "_free_end": []}


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", None])
def test_curve_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match=r"rows must be an integer >= 1, got"):
        hilbert_curve(bad, 4)
    with pytest.raises(ValueError, match=r"cols must be an integer >= 1, got"):
        hilbert_curve(4, bad)


# ---------------------------------------------------------------------------------- the layout
PATTERNS = [
    DilatedPattern([16, 64], [1, 4]),  # R divides w
    DilatedPattern([12, 40], [1, 3]),  # ragged last grid row: 14 x 3 cells for 40 offsets
    DilatedPattern([8, 24, 56], [1, 2, 5], query_dilation="all"),
    DilatedPattern([7], [7], query_dilation="all"),  # one row per segment
    DilatedPattern([32], [1]),  # dense: identity
]


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
@pytest.mark.parametrize("seq_len", [0, 1, 5, 40, 97, 257, 1025])
def test_permutation_properties(pattern, seq_len):
    perm, inv = hilbert_permutation(seq_len, pattern)
    assert perm.dtype == inv.dtype == torch.int64
    assert perm.shape == inv.shape == (seq_len,)
    ar = torch.arange(seq_len)
    assert torch.equal(torch.sort(perm).values, ar)
    assert torch.equal(perm[inv], ar) and torch.equal(inv[perm], ar)
    w, rate = pattern.max_segment, pattern.max_rate
    # Tokens never leave their segment of the longest config (the last one may be partial):
    # storage block [s*w, (s+1)*w) holds exactly the positions of segment s.
    assert torch.equal(perm // w, ar // w)
    # Inside a segment, offsets follow the curve over the ceil(w/R) x R grid (cells whose
    # offset is >= w, or whose position is >= seq_len, are skipped).
    curve = hilbert_curve(-(-w // rate), rate)
    order = curve[curve < w]
    for s in range(-(-seq_len // w)):
        got = perm[s * w:(s + 1) * w] - s * w
        assert torch.equal(got, order[order < seq_len - s * w]), f"segment {s}"
    if rate == 1:
        assert torch.equal(perm, ar)


def test_permutation_is_not_trivial():
    perm, _ = hilbert_permutation(64, DilatedPattern([16, 64], [1, 4]))
    assert not torch.equal(perm, torch.arange(64))
    # the 16 x 4 grid of the segment starts like a Hilbert curve: cells (0,0),(0,1),(1,1),(1,0)
    # or its transpose, i.e. offsets {0, 1, 4, 5} first.
    assert sorted(perm[:4].tolist()) == [0, 1, 4, 5]


def test_permutation_cached():
    p = DilatedPattern([12, 40], [1, 3])
    a = hilbert_permutation(97, p)
    b = hilbert_permutation(97, DilatedPattern([12, 40], [1, 3], ordering="hilbert"))
    c = hilbert_permutation(97, p, device="cpu")
    assert a[0] is b[0] is c[0] and a[1] is b[1] is c[1]
    assert hilbert_permutation(98, p)[0] is not a[0]
    # per device: a second device gets its own cached copy with the same values
    m = hilbert_permutation(97, p, device="meta")
    assert m[0].device.type == "meta" and m[0] is hilbert_permutation(97, p, device="meta")[0]
    # integer-like lengths share the cache entry
    assert hilbert_permutation(torch.tensor(97), p)[0] is a[0]


def test_permutation_rejects_bad_input():
    p = DilatedPattern([8], [2], query_dilation="all")
    with pytest.raises(ValueError, match=r"seq_len must be an integer >= 0, got -1"):
        hilbert_permutation(-1, p)
    with pytest.raises(ValueError, match=r"seq_len must be an integer >= 0, got 3.0"):
        hilbert_permutation(3.0, p)
    with pytest.raises(TypeError, match=r"pattern must be a DilatedPattern, got dict"):
        hilbert_permutation(8, p.to_dict())


def test_to_from_storage_roundtrip_and_grad():
    p = DilatedPattern([12, 40], [1, 3])
    perm, inv = hilbert_permutation(97, p)
    x = torch.randn(2, 3, 97, 5, requires_grad=True)
    xs = to_storage(x, perm, dim=2)
    assert torch.equal(xs[:, :, 7], x[:, :, perm[7]].detach())
    back = from_storage(xs, inv, dim=-2)
    assert torch.equal(back, x)
    g = torch.randn_like(x)
    (gx,) = torch.autograd.grad(back, x, g)
    assert torch.equal(gx, g)
    # other dims, e.g. [B, S, H, D]
    y = torch.randn(2, 97, 3, 4)
    assert torch.equal(from_storage(to_storage(y, perm, 1), inv, 1), y)


def test_storage_ordering():
    p = DilatedPattern([12, 40], [1, 3])
    assert storage_ordering(p, 97, ordering="natural") == "natural"
    assert storage_ordering(p, 97, ordering="hilbert") == "hilbert"
    assert storage_ordering(p, 97) == "natural"  # pattern.ordering
    assert storage_ordering(p.replace(ordering="hilbert"), 97) == "hilbert"
    assert storage_ordering(DilatedPattern([12], [1], ordering="hilbert"), 97) == "natural"
    assert resolve_ordering(p, 97, 64) in ("natural", "hilbert")
    assert storage_ordering(p, 97, 64, ordering="auto") == resolve_ordering(p, 97, 64)
    with pytest.raises(ValueError, match=r"ordering must be one of .* got 'zorder'"):
        storage_ordering(p, 97, ordering="zorder")


# ---------------------------------------------------------------------------------- invariance
def _attend(impl, q, k, v, pattern, causal, positions=None):
    kw = dict(causal=causal, q_positions=positions, k_positions=positions)
    if impl == "reference":
        return reference_attention(q, k, v, pattern, **kw)
    return dilated_attention(q, k, v, pattern, backend="torch", **kw)


def _check_invariance(impl, pattern, causal, b, hq, hkv, s, d):
    """permute -> attend (with true positions) -> unpermute == natural order, out and grads."""
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k = torch.randn(b, hkv, s, d, requires_grad=True)
    v = torch.randn(b, hkv, s, d, requires_grad=True)
    g = torch.randn(b, hq, s, d)

    out = _attend(impl, q, k, v, pattern, causal)
    grads = torch.autograd.grad(out, (q, k, v), g)

    perm, inv = hilbert_permutation(s, pattern)
    qs, ks, vs = (to_storage(t, perm, dim=2) for t in (q, k, v))
    out_h = from_storage(_attend(impl, qs, ks, vs, pattern, causal, positions=perm), inv, dim=2)
    grads_h = torch.autograd.grad(out_h, (q, k, v), g)

    # the same sums in another order: each within the sums' bound of the exact result, so
    # twice that between them (conftest.attention_tol)
    tol = 2 * attention_tol(s, d)
    assert_close("out", out_h.detach(), out.detach(), tol)
    for name, gh, gn in zip(("dq", "dk", "dv"), grads_h, grads):
        assert_close(name, gh, gn, tol)

    # The check can fail: the same storage order read as natural positions is another function.
    wrong = from_storage(_attend(impl, qs, ks, vs, pattern, causal), inv, dim=2)
    assert (wrong - out).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "pattern",
    [DilatedPattern([12, 40], [1, 3]),
     DilatedPattern([8, 24, 56], [1, 2, 5], query_dilation="all")],
    ids=str,
)
def test_hilbert_layout_computes_the_same_function(impl, causal, pattern):
    # 97 tokens, GQA 4:2, D = 40; the ragged grid rows and the partial last segment included.
    _check_invariance(impl, pattern, causal, b=2, hq=4, hkv=2, s=97, d=40)


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_hilbert_layout_long_odd_sequence(impl):
    # 1025 tokens: two full segments of 512 (a 64 x 8 grid each) and one token in a third.
    pattern = DilatedPattern([64, 256, 512], [1, 4, 8], ordering="hilbert")
    _check_invariance(impl, pattern, True, b=1, hq=2, hkv=1, s=1025, d=16)


def test_op_honours_pattern_ordering(monkeypatch):
    # ordering="hilbert" is a setting of the op: self-attention over 0..S-1 is computed in the
    # Hilbert layout (same function); calls with explicit positions are already in storage order.
    from hf_hilbert_attn import ops

    calls = []
    real = ops.hilbert_permutation
    monkeypatch.setattr(ops, "hilbert_permutation",
                        lambda n, p, device=None: calls.append(n) or real(n, p, device))
    ops._PREPARED.clear()  # (a prepared call keeps its permutation)
    p = DilatedPattern([12, 40], [1, 3])
    q, k, v = torch.randn(2, 4, 97, 16), torch.randn(2, 2, 97, 16), torch.randn(2, 2, 97, 16)
    ref, ref_lse = dilated_attention(q, k, v, p, backend="torch", return_lse=True)
    assert calls == []
    out, lse = dilated_attention(q, k, v, p.replace(ordering="hilbert"), backend="torch",
                                 return_lse=True)
    assert calls == [97]
    tol = 2 * attention_tol(97, 16)  # the same sums in another order
    assert_close("out", out, ref, tol)
    assert_close("lse", lse, ref_lse, tol)
    calls.clear()
    pos = torch.arange(97)
    dilated_attention(q, k, v, p.replace(ordering="hilbert"), backend="torch", q_positions=pos,
                      k_positions=pos)
    dilated_attention(q, k, v, p.replace(ordering="auto"), backend="torch")  # measured: natural
    assert calls == []
    # the layout as an option of the call (the pattern is the rule only): the same path
    out2 = dilated_attention(q, k, v, p, backend="torch", ordering="hilbert")
    assert calls == [97]
    assert torch.equal(out2, out)
    calls.clear()
    dilated_attention(q, k, v, p.replace(ordering="hilbert"), backend="torch", ordering="natural")
    assert calls == []
    with pytest.raises(ValueError, match="ordering must be one of"):
        dilated_attention(q, k, v, p, backend="torch", ordering="snake")
