"""Sink tokens and sliding windows (README, "The pattern") on the chunked PyTorch path
(``dilated_attention(..., backend="torch")``) against ``reference_attention`` in float64: out,
lse, dq, dk, dv on fresh random patterns of both window kinds, with and without sinks (also more
sinks than tokens), GQA, odd sizes, decode, Hilbert-permuted positions, packed documents, left
padding; results written into poisoned tensors; and the bound on the work a sliding plan does.

Exact vs close: outputs and the gradients of ``<out, dout>`` are float64 end to end (tight);
``lse`` is returned in float32, so it and the gradients through it are only float32-close.
"""

import random

import pytest
import torch

import helpers
from conftest import LSE_MAX, attention_tol, lse_float32_tol
from helpers import assert_close
from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn.engines import passes as chunked_module
from hf_hilbert_attn.hilbert import hilbert_permutation
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.backends import TORCH

# float64 all the way: the sums' bound at the file's largest shapes (300 keys, head_dim 16),
# about 4e-13 (conftest.attention_tol)
F64_TOL = attention_tol(300, 16, torch.float64)
# lse is returned in float32 (one rounding); what flows through it is read twice by the
# backward (P and dS), so twice that (conftest.lse_float32_tol)
LSE_TOL = 2 * lse_float32_tol(LSE_MAX)


def random_pattern(rng: random.Random, length: int, window: str, sinks: int,
                   mode=None) -> DilatedPattern:
    """Half the time nested windows with power-of-two rates (the planner's class-free windows
    and skipped blocks)."""
    return helpers.random_pattern(rng, length, mode=mode, window=window, sinks=sinks, nested=True)


def draw_sinks(rng: random.Random, length: int) -> int:
    return rng.choice([0, 1, 3, rng.randrange(5, 40, 2), length + rng.randint(1, 5)])


def qkv(b, hq, hkv, sq, sk, d, dv=None):
    return (torch.randn(b, hq, sq, d, dtype=torch.float64),
            torch.randn(b, hkv, sk, d, dtype=torch.float64),
            torch.randn(b, hkv, sk, dv or d, dtype=torch.float64))


def _run(fn, q, k, v, pattern, dout, dlse, **kw):
    """out, lse, the gradients of <out, dout>, and those of <out, dout> + <lse, dlse>."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v, pattern, return_lse=True, **kw)
    g_out = torch.autograd.grad((out * dout).sum(), (q, k, v), retain_graph=True)
    lse_term = torch.where(torch.isfinite(lse), lse.double() * dlse, 0.0).sum()
    g_all = torch.autograd.grad((out * dout).sum() + lse_term, (q, k, v))
    return out.detach(), lse.detach().double(), g_out, g_all


def ours(q, k, v, pattern, **kw):
    return dilated_attention(q, k, v, pattern, backend="torch", **kw)


def ref64(q, k, v, pattern, **kw):
    return reference_attention(q, k, v, pattern, dtype=torch.float64, **kw)


def check(q, k, v, pattern, **kw):
    """Ours vs the float64 reference (fresh random cotangents); returns ours."""
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    dlse = torch.randn(q.shape[:-1], dtype=torch.float64)
    got = _run(ours, q, k, v, pattern, dout, dlse, **kw)
    want = _run(ref64, q, k, v, pattern, dout, dlse, **kw)
    causal = "causal" if kw.get("causal", True) else "non-causal"
    what = f"{pattern} {causal} q{tuple(q.shape)} k{tuple(k.shape)}"
    assert_close("out", got[0], want[0], F64_TOL, what)
    assert_close("lse", got[1], want[1], LSE_TOL, what)
    for name, a, b in zip(("dq", "dk", "dv"), got[2], want[2]):
        assert_close(name, a, b, F64_TOL, what)
    for name, a, b in zip(("dq", "dk", "dv"), got[3], want[3]):
        assert_close(name + " (with lse)", a, b, LSE_TOL, what)
    return got


# ------------------------------------------------------------------------------ random patterns
@pytest.mark.parametrize("window", ["segment", "sliding"])
@pytest.mark.parametrize("causal", [True, False])
def test_random_patterns_match_reference(window, causal):
    rng = random.Random(torch.initial_seed())
    for s in (1, 37, 97, 300):
        for _ in range(2 if s < 300 else 1):
            pattern = random_pattern(rng, s, window, draw_sinks(rng, s))
            hkv = rng.choice([1, 2])
            hq = hkv * rng.choice([1, 2, 3])
            q, k, v = qkv(rng.choice([1, 2]), hq, hkv, s, s, rng.choice([8, 12]))
            check(q, k, v, pattern, causal=causal, scale=rng.uniform(0.1, 0.5))


@pytest.mark.parametrize("mode", ["per_head", "all"])
def test_longnet_like_sliding_with_sinks(mode):
    # the shape of the benchmark pattern (nested windows, rates 1..16), scaled down, GQA
    pattern = DilatedPattern([16, 32, 64, 128, 256], [1, 2, 4, 8, 16], query_dilation=mode,
                             window="sliding", sink_tokens=4)
    q, k, v = qkv(1, 9, 3, 300, 300, 16)
    check(q, k, v, pattern, causal=True)


def test_sinks_beyond_the_sequence_are_dense_attention():
    # every key is a sink: plain causal attention, whatever the configs
    s = 37
    pattern = DilatedPattern([5, 9], [1, 3], window=random.choice(["segment", "sliding"]),
                             sink_tokens=s + 3)
    q, k, v = qkv(2, 4, 2, s, s, 8)
    out = ours(q, k, v, pattern)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, want, atol=2 * attention_tol(s, 8, torch.float64), rtol=0)


# ------------------------------------------------------------------------------ decode, Sq < Sk
@pytest.mark.parametrize("window", ["segment", "sliding"])
@pytest.mark.parametrize("sq, sk", [(1, 97), (13, 300), (1, 1)])
def test_decode(window, sq, sk):
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, sk, window, draw_sinks(rng, sk))
    q, k, v = qkv(2, 4, 2, sq, sk, 16)
    causal = rng.random() < 0.7
    check(q, k, v, pattern, causal=causal)  # queries are the last sq positions
    # the same with explicit positions equals the default alignment to float64 rounding (the
    # default alignment lets the engines drop configs others cover, planning.for_ranges, so the
    # sums may run in another order: 4e-16 apart seen)
    got = ours(q, k, v, pattern, causal=causal, q_positions=torch.arange(sk - sq, sk),
               k_positions=torch.arange(sk))
    torch.testing.assert_close(got, ours(q, k, v, pattern, causal=causal), rtol=0, atol=F64_TOL)


# ------------------------------------------------------------------------------ storage order
@pytest.mark.parametrize("window", ["segment", "sliding"])
def test_hilbert_permuted_positions(window):
    """Tokens stored in the pattern's Hilbert order: the reference with the same positions, and
    permute -> attend -> unpermute equals natural order (out, lse and all gradients)."""
    rng = random.Random(torch.initial_seed())
    s = 300
    pattern = random_pattern(rng, 64, window, draw_sinks(rng, s))
    pattern = pattern.replace(segment_lengths=[w + 32 for w in pattern.segment_lengths])
    perm, inv = hilbert_permutation(s, pattern)
    assert not torch.equal(perm, torch.arange(s)) or pattern.max_rate == 1
    q, k, v = qkv(1, 4, 2, s, s, 16)
    causal = rng.random() < 0.7
    stored = check(q[:, :, perm], k[:, :, perm], v[:, :, perm], pattern, causal=causal,
                   q_positions=perm, k_positions=perm)
    dout = torch.randn(1, 4, s, 16, dtype=torch.float64)
    dlse = torch.randn(1, 4, s, dtype=torch.float64)
    natural = _run(ours, q, k, v, pattern, dout, dlse, causal=causal)
    back = _run(ours, q[:, :, perm], k[:, :, perm], v[:, :, perm], pattern, dout[:, :, perm],
                dlse[:, :, perm], causal=causal, q_positions=perm, k_positions=perm)
    for name, a, b in zip(("out", "lse"), back[:2], natural[:2]):
        assert_close(name, a[:, :, inv], b, LSE_TOL if name == "lse" else F64_TOL, "unpermuted")
    for name, a, b in zip(("dq", "dk", "dv"), back[2], natural[2]):
        assert_close(name, a[:, :, inv], b, F64_TOL, "unpermuted")
    assert stored[0].shape == (1, 4, s, 16)


def test_positions_too_far_apart_for_one_search_key():
    # two clusters 2^61 apart: (class, position) no longer fits one int64 key, so the band
    # search takes its per-class path; windows never join the clusters, sinks reach both
    rng = random.Random(torch.initial_seed())
    n = 40
    pos = torch.cat([torch.arange(n), torch.arange(n) + 2**61])[torch.randperm(2 * n)]
    pattern = DilatedPattern([9, 20], [1, 4], window="sliding", sink_tokens=3,
                             query_dilation=rng.choice(["per_head", "all"]))
    q, k, v = qkv(1, 4, 2, 2 * n, 2 * n, 8)
    check(q, k, v, pattern, causal=rng.random() < 0.5, q_positions=pos, k_positions=pos)


# ------------------------------------------------------------------------------ documents, padding
def packed(b, s, rng, max_doc):
    """Packed documents: positions restart per document, doc ids count up; the last row ends
    with a few padding tokens (doc id -1)."""
    pos = torch.zeros(b, s, dtype=torch.int64)
    doc = torch.zeros(b, s, dtype=torch.int64)
    for i in range(b):
        j, n_doc = 0, 0
        while j < s:
            n = min(rng.randint(1, max_doc), s - j)
            pos[i, j:j + n] = torch.arange(n)
            doc[i, j:j + n] = n_doc
            j, n_doc = j + n, n_doc + 1
    doc[-1, s - rng.randint(1, 5):] = -1
    return pos, doc


@pytest.mark.parametrize("window", ["segment", "sliding"])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_have_their_own_sinks(window, causal):
    rng = random.Random(torch.initial_seed())
    s = 300
    pattern = random_pattern(rng, 60, window, rng.choice([1, 3, 7]))
    pos, doc = packed(2, s, rng, 60)
    q, k, v = qkv(2, 4, 2, s, s, 8)
    check(q, k, v, pattern, causal=causal, q_positions=pos, k_positions=pos, q_doc_ids=doc,
          k_doc_ids=doc)
    # one row: the sink pass groups tiles by document
    check(q[:1], k[:1], v[:1], pattern, causal=causal, q_positions=pos[:1], k_positions=pos[:1],
          q_doc_ids=doc[:1], k_doc_ids=doc[:1])


def test_per_row_documents_on_shared_positions():
    # positions shared by the rows, document ids per row: one plan, sinks masked per row
    rng = random.Random(torch.initial_seed())
    s = 97
    pattern = random_pattern(rng, 40, random.choice(["segment", "sliding"]), 2)
    doc = torch.stack([torch.arange(s) // rng.randint(5, 60) for _ in range(3)])
    doc[1, :7] = -1
    q, k, v = qkv(3, 2, 1, s, s, 8)
    check(q, k, v, pattern, causal=True, k_positions=torch.arange(s), q_doc_ids=doc,
          k_doc_ids=doc)


@pytest.mark.parametrize("window", ["segment", "sliding"])
def test_left_padding_is_never_a_sink(window):
    """Hugging Face left padding: padding keys (doc id -1) sit at position 1, inside the sinks;
    they are never attended, and padding queries attend nothing."""
    rng = random.Random(torch.initial_seed())
    b, s = 3, 97
    mask = torch.ones(b, s, dtype=torch.int64)
    for i in range(1, b):
        mask[i, : rng.randint(1, s - 1)] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    doc = torch.where(mask == 1, 0, -1)
    pattern = random_pattern(rng, s, window, rng.choice([2, 3, 5]))
    q, k, v = qkv(b, 4, 2, s, s, 8)
    got = check(q, k, v, pattern, causal=True, q_positions=pos, k_positions=pos, q_doc_ids=doc,
                k_doc_ids=doc)
    pad = doc < 0
    out, lse, (_, dk, _) = got[0], got[1], got[2]
    assert bool((out.transpose(1, 2)[pad] == 0).all())
    assert bool((lse.transpose(1, 2)[pad] == float("-inf")).all())
    assert bool((dk.transpose(1, 2)[pad] == 0).all()), "a padding key received gradient"


# ------------------------------------------------------------------------------ poisoned outputs
@pytest.mark.parametrize("window", ["segment", "sliding"])
def test_results_written_into_poisoned_tensors(window):
    """The backend seam's forward / backward (the ring's piece calls) write every element of
    the tensors they are given (NaN-poisoned first), on the PyTorch path."""
    rng = random.Random(torch.initial_seed())
    s = 97
    pattern = random_pattern(rng, s, window, draw_sinks(rng, s))
    q, k, v = qkv(2, 4, 2, s, s, 8)
    causal = rng.random() < 0.7
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"))
    a = check_inputs(q, k, v, pattern)
    TORCH.forward(q, k, v, pattern, a, causal, out=out, lse=lse)
    want, want_lse = ref64(q, k, v, pattern, causal=causal, return_lse=True)
    assert_close("out", out, want, F64_TOL, str(pattern))
    assert_close("lse", lse, want_lse, LSE_TOL, str(pattern))
    dout = torch.randn_like(out)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    TORCH.backward(dout, None, q, k, v, out, lse, pattern, a, causal, grads=grads)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_grads = torch.autograd.grad((ref64(qq, kk, vv, pattern, causal=causal) * dout).sum(),
                                    (qq, kk, vv))
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, a, b, LSE_TOL, str(pattern))  # from the float32 lse


# ------------------------------------------------------------------------------ bounded work
def _plan_work(pattern, sq, sk, heads, causal=True):
    """(score elements computed, key chunks visited) of the chunked path's plan."""
    q = torch.empty(1, heads, sq, 1)
    k = torch.empty(1, 1, sk, 1)
    a = check_inputs(q, k, k, pattern)
    work = chunks = 0
    for ps in chunked_module._plan(pattern, a, causal):
        for lo, hi, cs in ps.tiles:
            work += sum((hi - lo) * (c[1] - c[0]) for c in cs) * ps.head_ids.numel()
            chunks += len(cs)
    return work, chunks


@pytest.mark.parametrize("mode", ["per_head", "all"])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_plan_visits_only_the_band(mode, causal):
    """At S = 16384 a sliding pattern's plan computes at most ~1.5x its allowed pairs
    (count_pairs), a small fraction of what the same configs' dense class passes would; a
    decode step touches only its window and the sinks."""
    s, heads = 16384, 4
    pattern = DilatedPattern([256, 1024], [1, 4], query_dilation=mode, window="sliding",
                             sink_tokens=2)
    useful = pattern.count_pairs_total(s, heads, causal=causal)
    work, _ = _plan_work(pattern, s, s, heads, causal)
    dense, _ = _plan_work(DilatedPattern.dense(s), s, s, heads, causal)
    # measured (2026-11, CHUNK 512): 1.18-1.28x the pairs; dense computes 15-23x more
    assert useful <= work <= 1.5 * useful, work / useful
    assert work * 10 < dense, dense / work
    # one query at the end: its 256 + 1024/4 window keys and 2 sinks, in a few chunks
    work, chunks = _plan_work(pattern, 1, s, heads, causal)
    assert work <= heads * (256 + 256 + 2) and chunks <= 4 * heads, (work, chunks)


def test_sliding_never_allocates_sq_by_sk():
    """Longer key chunks for the smaller sliding tiles keep the block size: the largest tensor
    is still an input / accumulator or one block of scores, forward and backward."""
    from test_ops import _LargestTensor

    s = 8192  # one [Sq, 512] block of scores per head is already 2x over the limit
    pattern = DilatedPattern([256, 1024], [1, 4], window="sliding", sink_tokens=4)
    q, k, v = (torch.randn(1, h, s, 16, requires_grad=True) for h in (4, 2, 2))
    with _LargestTensor() as watch:
        out, lse = dilated_attention(q, k, v, pattern, backend="torch", return_lse=True)
        (out.sum() + lse.sum()).backward()
    assert bool(torch.isfinite(lse).all()) and bool(torch.isfinite(q.grad).all())
    limit = max(q.numel(), 4 * chunked_module.CHUNK_Q * chunked_module.CHUNK_K) * 2
    assert watch.numel <= limit, f"{watch.op} returned {watch.numel} elements (limit {limit})"
