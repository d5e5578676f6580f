"""``dilated_attention(backend="torch")`` (the chunked PyTorch path) against ``reference_attention``:
out, lse, dq, dk, dv on fresh random patterns and shapes, and its memory / block-skipping."""

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn.engines import passes as chunked_module
from conftest import attention_tol, lse_float32_tol
from helpers import assert_close, random_pattern

NAMES = ("out", "lse", "dq", "dk", "dv")


def ours(q, k, v, pattern, **kw):
    return dilated_attention(q, k, v, pattern, backend="torch", **kw)


def reference64(q, k, v, pattern, **kw):
    return reference_attention(q.double(), k.double(), v.double(), pattern, dtype=torch.float64, **kw)


def run(fn, q, k, v, pattern, dout, dlse=None, **kw):
    """out, lse and the gradients of ``<out, dout> + <lse, dlse>`` w.r.t. q, k, v."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v, pattern, return_lse=True, **kw)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse).sum()
    loss.backward()
    return [out.detach(), None if lse is None else lse.detach(), q.grad, k.grad, v.grad]


def assert_match(got, want, tol, what=""):
    """Each of out/lse/dq/dk/dv close to the reference (``helpers.assert_close``); -inf lse and
    their zero outputs must match exactly. lse is float32 for every input dtype, so its
    tolerance is at least one float32 rounding (``conftest.lse_float32_tol``)."""
    for name, a, b in zip(NAMES, got, want):
        assert_close(name, a, b, max(tol, lse_float32_tol()) if name == "lse" else tol, what)


def qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, dv=None):
    return (torch.randn(b, hq, sq, d, dtype=dtype), torch.randn(b, hkv, sk, d, dtype=dtype),
            torch.randn(b, hkv, sk, dv or d, dtype=dtype))


def check(q, k, v, pattern, tol=None, lse_grad=True, **kw):
    """Compare ours to the float64 reference (fresh random cotangents); returns ours. ``tol``:
    by default the sums' bound for these shapes and dtype (``conftest.attention_tol``)."""
    if tol is None:
        tol = attention_tol(max(q.shape[2], k.shape[2]), max(q.shape[3], v.shape[3]), q.dtype)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    want_lse = reference64(q, k, v, pattern, return_lse=True, **kw)[1]
    dlse = None
    if lse_grad and bool(torch.isfinite(want_lse).all()):
        dlse = torch.randn(want_lse.shape, dtype=torch.float64)
    got = run(ours, q, k, v, pattern, dout, dlse, **kw)
    want = run(reference64, q, k, v, pattern, dout, dlse, **kw)
    assert got[0].dtype == q.dtype and got[1].dtype == torch.float32
    assert_match(got, want, tol, what=str(pattern))
    return got


# ------------------------------------------------------------------------------ random shapes
@pytest.mark.parametrize("mode", ["per_head", "all"])
@pytest.mark.parametrize(
    "b, hq, hkv, s, d, causal",
    [
        (2, 4, 2, 97, 40, True),
        (1, 6, 2, 97, 80, False),
        (2, 3, 3, 97, 128, True),
        (1, 8, 1, 64, 16, False),
        (1, 2, 1, 1025, 40, True),
    ],
)
def test_matches_reference(b, hq, hkv, s, d, causal, mode):
    rng = random.Random(torch.initial_seed())
    for _ in range(2 if s < 1000 else 1):
        pattern = random_pattern(rng, s, mode=mode)
        q, k, v = qkv(b, hq, hkv, s, s, d)
        check(q, k, v, pattern, causal=causal, scale=rng.uniform(0.05, 0.5))


def test_longnet_like_1025():
    # Nested power-of-two segments with large rates: every kind of config at once, GQA.
    pattern = DilatedPattern([64, 256, 1024], [1, 4, 16])
    q, k, v = qkv(1, 4, 2, 1025, 1025, 64)
    check(q, k, v, pattern, causal=True)


def test_float64_is_tight():
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, 97)
    q, k, v = qkv(2, 4, 2, 97, 97, 16, dtype=torch.float64)
    # lse is returned in float32 (its gradient too), so leave it out of the loss here.
    got = check(q, k, v, pattern, lse_grad=False, causal=bool(rng.getrandbits(1)))  # ~2e-13
    assert got[0].dtype == torch.float64 and got[2].dtype == torch.float64


def test_head_dim_v_differs_and_non_contiguous():
    # Hugging Face hands over [B, S, H, D] transposed to [B, H, S, D]: strided inputs.
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, 50)
    q = torch.randn(2, 50, 4, 24).transpose(1, 2)
    k = torch.randn(2, 50, 2, 24).transpose(1, 2)
    v = torch.randn(2, 50, 2, 8).transpose(1, 2)
    check(q, k, v, pattern, causal=True)


# ------------------------------------------------------------------------------ decode, Sq < Sk
@pytest.mark.parametrize("sq, sk", [(1, 97), (1, 1), (13, 200), (96, 97)])
@pytest.mark.parametrize("causal", [True, False])
def test_decode(sq, sk, causal):
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, sk)
    q, k, v = qkv(2, 4, 2, sq, sk, 32)
    check(q, k, v, pattern, causal=causal)  # default: queries are the last sq positions
    # the same with explicit positions equals the default alignment
    got = ours(q, k, v, pattern, causal=causal, q_positions=torch.arange(sk - sq, sk),
               k_positions=torch.arange(sk))
    torch.testing.assert_close(got, ours(q, k, v, pattern, causal=causal), rtol=0, atol=0)


# ------------------------------------------------------------------------------ padding, packing
def left_padding(b, s, rng):
    """Hugging Face style left padding: key doc id -1 on padding, positions cumsum(mask) - 1
    (padding positions set to 1, as ``generate`` does)."""
    mask = torch.ones(b, s, dtype=torch.int64)
    for i in range(1, b):
        mask[i, : rng.randint(1, s - 1)] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    doc = torch.where(mask == 1, 0, -1)
    return pos, doc


def packed(b, s, rng, max_doc):
    """Packed documents: positions restart per document (as DataCollatorWithFlattening makes
    them), doc ids count up; the last row ends with a few padding tokens (doc id -1)."""
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


@pytest.mark.parametrize("causal", [True, False])
def test_left_padding(causal):
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, 97)
    pos, doc = left_padding(3, 97, rng)
    q, k, v = qkv(3, 4, 2, 97, 97, 40)
    got = check(q, k, v, pattern, causal=causal, q_positions=pos, k_positions=pos,
                q_doc_ids=doc, k_doc_ids=doc)
    # padding queries attend nothing: output exactly 0, lse -inf, zero gradient
    pad = doc < 0
    assert bool(pad.any())
    assert torch.equal(got[0].permute(0, 2, 1, 3)[pad], torch.zeros_like(got[0].permute(0, 2, 1, 3)[pad]))
    assert bool((got[1].permute(0, 2, 1)[pad] == float("-inf")).all())
    assert bool((got[2].permute(0, 2, 1, 3)[pad] == 0).all())
    # padding keys receive no gradient
    assert bool((got[3].permute(0, 2, 1, 3)[pad] == 0).all())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s, max_doc", [(97, 40), (700, 300)])
def test_packed_documents(causal, s, max_doc):
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, max_doc)
    pos, doc = packed(2, s, rng, max_doc)
    q, k, v = qkv(2, 4, 2, s, s, 16)
    check(q, k, v, pattern, causal=causal, q_positions=pos, k_positions=pos, q_doc_ids=doc,
          k_doc_ids=doc)


@pytest.mark.parametrize("expanded", [False, True])
def test_packed_shared_positions_per_row_docs(expanded):
    # positions shared by the batch ([S], or [B, S] with equal rows), document ids per row:
    # the plan is shared, the masks are not.
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, 90)
    s = 90
    doc = torch.stack([torch.arange(s) // rng.randint(5, 60) for _ in range(3)])
    doc[1, :7] = -1
    pos = torch.arange(s).expand(3, s).clone() if expanded else torch.arange(s)
    q, k, v = qkv(3, 2, 1, s, s, 16)
    check(q, k, v, pattern, causal=True, k_positions=pos, q_doc_ids=doc, k_doc_ids=doc)


def test_query_without_keys():
    # A query in a document that has no key at all (Sq < Sk; its keys are padding) and a query
    # whose only keys are padding: out 0, lse -inf, finite gradients that equal the reference.
    pattern = DilatedPattern([8, 32], [1, 4])
    sq, sk = 10, 40
    q, k, v = qkv(2, 4, 2, sq, sk, 16)
    k_doc = torch.zeros(2, sk, dtype=torch.int64)
    k_doc[:, :5] = -1  # padding keys, nominally of document "-1"
    q_doc = torch.zeros(2, sq, dtype=torch.int64)
    q_doc[0, 3] = 7  # a document with no key
    q_doc[1, 4] = -1  # a padding query
    got = check(q, k, v, pattern, causal=True, q_positions=torch.arange(sk - sq, sk),
                k_positions=torch.arange(sk), q_doc_ids=q_doc, k_doc_ids=k_doc)
    for b, i in ((0, 3), (1, 4)):
        assert bool((got[0][b, :, i] == 0).all()) and bool((got[1][b, :, i] == float("-inf")).all())
    assert all(bool(torch.isfinite(g).all()) for g in got[2:])
    assert bool((got[2][0, :, 3] == 0).all())


def test_all_padding_batch_row():
    pattern = DilatedPattern([16], [1])
    q, k, v = qkv(2, 2, 1, 20, 20, 8)
    doc = torch.zeros(2, 20, dtype=torch.int64)
    doc[1] = -1
    got = check(q, k, v, pattern, causal=False, q_doc_ids=doc, k_doc_ids=doc)
    assert torch.equal(got[0][1], torch.zeros_like(got[0][1]))
    assert bool((got[1][1] == float("-inf")).all())
    assert bool((got[2][1] == 0).all()) and bool((got[3][1] == 0).all())


# ------------------------------------------------------------------------------ storage order
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("s", [97, 600])
def test_permuted_storage_order(per_row, s):
    """permute -> attend -> unpermute equals natural order (outputs and all gradients)."""
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, s)
    b, causal = 2, bool(rng.getrandbits(1))
    q, k, v = qkv(b, 4, 2, s, s, 16)
    dout = torch.randn(b, 4, s, 16, dtype=torch.float64)
    dlse = torch.randn(b, 4, s, dtype=torch.float64)
    natural = run(ours, q, k, v, pattern, dout, dlse, causal=causal)
    perm = torch.stack([torch.randperm(s) for _ in range(b)]) if per_row else torch.randperm(s)[None]
    perm = perm.expand(b, s)
    inv = perm.argsort(-1)

    def gather(t, idx):  # t [B, H, S, ...] -> stored in the order idx [B, S]
        idx = idx[:, None, :].expand(t.shape[0], t.shape[1], -1)
        if t.dim() == 4:
            idx = idx[..., None].expand(-1, -1, -1, t.shape[-1])
        return t.gather(2, idx)

    pos = perm if per_row else perm[:1]
    stored = run(ours, gather(q, perm), gather(k, perm), gather(v, perm), pattern,
                 gather(dout, perm), gather(dlse, perm), causal=causal, q_positions=pos, k_positions=pos)
    back = [gather(t, inv) for t in stored]
    tol = attention_tol(s, 16)  # each order within this of the exact result: twice between them
    assert_match(back, natural, 2 * tol, what=f"permuted {pattern}")
    want = run(reference64, q, k, v, pattern, dout, dlse, causal=causal)
    assert_match(natural, want, tol, what=str(pattern))


# ------------------------------------------------------------------------------ low precision
def sdpa_same_pattern(q, k, v, pattern, causal):
    """PyTorch's own masked attention in the input dtype (the baseline error)."""
    mask = pattern.build_mask(q.shape[1], torch.arange(k.shape[2] - q.shape[2], k.shape[2]),
                              torch.arange(k.shape[2]), causal=causal)
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                          attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s, d, causal", [(97, 40, True), (300, 64, False), (257, 128, True)])
def test_low_precision_error_vs_pytorch(dtype, s, d, causal):
    """|ours - fp64 reference| <= 2 x |PyTorch SDPA in the same dtype - fp64 reference| for out,
    dq, dk, dv (every query has its own key, so no row is empty)."""
    rng = random.Random(torch.initial_seed())
    pattern = random_pattern(rng, s)
    q, k, v = qkv(2, 4, 2, s, s, d, dtype=dtype)
    dout = torch.randn(2, 4, s, d, dtype=dtype)
    want = run(reference64, q, k, v, pattern, dout, causal=causal)
    got = run(ours, q, k, v, pattern, dout, causal=causal)
    base = run(lambda q, k, v, p, return_lse: (sdpa_same_pattern(q, k, v, p, causal), None),
               q, k, v, pattern, dout)
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        assert got[i].dtype == dtype
        err = float((got[i].double() - want[i]).abs().max())
        err_pt = float((base[i].double() - want[i]).abs().max())
        # floor: ours accumulates in float32 (conftest rule 2's floor, for an exact baseline)
        assert err <= 2 * err_pt + attention_tol(s, d), (
            f"{dtype} {name}: ours {err:.3g} vs PyTorch {err_pt:.3g}")
    # lse is computed in float32 from the low-precision inputs; compare with the reference
    assert_match([got[1]], [want[1]], attention_tol(s, d))


# ------------------------------------------------------------------------------ memory, skipping
class _LargestTensor(TorchDispatchMode):
    """Records the largest storage (in elements) behind any tensor an aten op returns, forward
    and backward; views (expand, slicing) count their base's storage, not their shape."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                n = t.untyped_storage().nbytes() // t.element_size()
                if n > self.numel:
                    self.numel, self.op = n, str(func)
        return out


def test_never_allocates_sq_by_sk():
    s = 16384
    pattern = DilatedPattern([1024, 4096, 16384], [1, 4, 16])
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 4, 2, s, s, 16))
    with _LargestTensor() as watch:
        out, lse = dilated_attention(q, k, v, pattern, backend="torch", return_lse=True)
        (out.sum() + lse.sum()).backward()
    assert bool(torch.isfinite(lse).all()) and bool(torch.isfinite(q.grad).all())
    # The largest tensors are the [B, Hq, S, D] inputs/accumulators and one block of scores
    # [B, Hq, CHUNK_Q, CHUNK_K]; a single [S, S] mask would be 16x over this limit.
    limit = s * s // 16
    assert watch.numel <= limit, f"{watch.op} returned {watch.numel} elements (limit {limit})"
    assert watch.numel <= max(q.numel(), 4 * chunked_module.CHUNK_Q * chunked_module.CHUNK_K) * 2


def _computed_pairs(pattern, s, heads, causal=True):
    """Score elements the chunked path computes (per head, summed), from its plan."""
    from hf_hilbert_attn.inputs import check_inputs

    q = torch.empty(1, heads, s, 1)
    k = torch.empty(1, 1, s, 1)
    a = check_inputs(q, k, k, pattern)
    total = 0
    for ps in chunked_module._plan(pattern, a, causal):
        for lo, hi, chunks in ps.tiles:
            total += sum((hi - lo) * (c[1] - c[0]) for c in chunks) * ps.head_ids.numel()
    return total


CONFIGS = str(Path(__file__).resolve().parent.parent / "hf_hilbert_attn" / "patterns")


@pytest.mark.parametrize(
    "pattern, s, bound",
    [
        # measured ratios (2026-11, CHUNK 512): 1.06, 1.37, 1.12, 1.80
        (DilatedPattern.dense(8192), 8192, 1.1),  # dense causal: only diagonal blocks waste
        (CONFIGS + "/longnet_lm.yaml", 16384, 1.45),
        (CONFIGS + "/pow2.yaml", 16384, 1.2),
        # "all" mode: a tile of config i spans several rate-1 segments of config 0, so the pairs
        # config 0 already owns are masked inside blocks rather than skipped whole.
        (DilatedPattern([1024, 4096, 16384], [1, 4, 16], query_dilation="all"), 16384, 1.9),
    ],
)
def test_block_skipping(pattern, s, bound):
    """The plan computes at most ``bound`` x the allowed pairs (count_pairs): blocks that hold
    no pair of their config (causal, other groups, covered by an earlier config) are skipped."""
    if isinstance(pattern, str):
        pattern = DilatedPattern.from_yaml(pattern)
    heads = 4
    useful = pattern.count_pairs_total(s, heads, causal=True)
    computed = _computed_pairs(pattern, s, heads)
    assert useful <= computed <= bound * useful, (computed / useful)


def test_autocast_casts_like_sdpa():
    pat = DilatedPattern([8, 16], [1, 2])
    q = torch.randn(1, 2, 20, 16)
    v = torch.randn(1, 2, 20, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dilated_attention(q, q, v, pat)
    assert out.dtype == torch.bfloat16
    want = dilated_attention(q.bfloat16(), q.bfloat16(), v, pat)
    assert torch.equal(out, want)  # the same computation: cast, then autocast off inside
    with pytest.raises(ValueError, match="must share a dtype"):  # outside autocast: no cast
        dilated_attention(q, q, v, pat)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_empty_batch_returns_empty_like_sdpa(backend):
    # batch size 0: an empty output (and lse, and gradients), as SDPA returns
    q, k, v = (torch.randn(0, 4, 13, 8, requires_grad=True) for _ in range(3))
    pattern = DilatedPattern([4, 8], [1, 2])
    out, lse = dilated_attention(q, k, v, pattern, return_lse=True, backend=backend)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == want.shape == (0, 4, 13, 8) and lse.shape == (0, 4, 13)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
