"""The dense-tile CPU path of ``dilated_attention(backend="torch")`` (``engines/tiles.py``:
PyTorch's fused CPU attention over class-coordinate tiles) against ``reference_attention``:
out and dq/dk/dv within 2x PyTorch's own error (SDPA with the pattern's mask, same dtype) of a
float64 reference, on fresh random data; the calls it leaves to the blockwise path; and a smoke
run of the CPU benchmark."""

import csv
import random

import pytest
import torch
import torch.nn.functional as F

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention
from hf_hilbert_attn.engines import tiles
from hf_hilbert_attn.inputs import check_inputs
from conftest import RANDN_MAX, attention_tol, lse_float32_tol
from helpers import assert_close, random_pattern

# Scaled-down shipped patterns (hf_hilbert_attn/patterns/*.yaml): longnet_lm's rates 6 and 12
# divide neither each other's segments nor 4 (masked tiles), default's sliding windows.
LONGNET = DilatedPattern([64, 128, 256, 512, 1024], [1, 2, 4, 6, 12])
DEFAULT = DilatedPattern([64, 128, 256, 512, 1024], [1, 2, 4, 8, 16], sink_tokens=1,
                         window="sliding")
ODD = DilatedPattern([48, 100, 300], [1, 3, 5], sink_tokens=3)  # nothing divides anything
ALL = DilatedPattern([40, 96, 200], [1, 2, 4], query_dilation="all", sink_tokens=2)
ALL_SLIDING = DilatedPattern([33, 70, 150], [1, 2, 6], query_dilation="all", window="sliding")


def fresh(b, hq, hkv, s, d, dtype):
    return [torch.randn(b, h, s, d, dtype=dtype) for h in (hq, hkv, hkv)]


def grads(fn, q, k, v, dout, dlse):
    """out and the gradients of ``<out, dout> + <lse, dlse>`` (lse term when ``dlse``)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.double() * dout).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse).sum()
    loss.backward()
    return out.detach(), q.grad, k.grad, v.grad


def sdpa_masked(pattern, causal):
    def fn(q, k, v):
        mask = pattern.build_mask(q.shape[1], torch.arange(q.shape[2]), torch.arange(k.shape[2]),
                                  causal=causal)
        g = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                             v.repeat_interleave(g, 1), attn_mask=mask)
        return out, None
    return fn


def check(pattern, b=2, hq=6, hkv=2, s=301, d=40, dtype=torch.float32, causal=True, fast=True,
          lse_grad=False):
    """Our out/dq/dk/dv error vs a float64 reference <= 2x SDPA's in ``dtype`` (plus a few
    ulps); ``fast``: whether the dense-tile plan must apply."""
    q, k, v = fresh(b, hq, hkv, s, d, dtype)
    a = check_inputs(q, k, v, pattern)
    assert (tiles.plan_whole(pattern, a, causal, q) is not None) == fast
    dout = torch.randn(b, hq, s, d, dtype=torch.float64)
    dlse = torch.randn(b, hq, s, dtype=torch.float64) if lse_grad else None

    def ours(q, k, v):
        return dilated_attention(q, k, v, pattern, causal=causal, backend="torch",
                                 return_lse=True)

    def ref(q, k, v):
        return reference_attention(q.double(), k.double(), v.double(), pattern, causal=causal,
                                   return_lse=True, dtype=torch.float64)

    want = grads(ref, q, k, v, dout, dlse)
    got = grads(ours, q, k, v, dout, dlse)
    # PyTorch's own error; with an lse gradient the baseline has none, so its out-only error
    base = grads(sdpa_masked(pattern, causal), q, k, v, dout, None)
    if lse_grad:
        want_o = grads(ref, q, k, v, dout, None)
        base = [bb.double() - wo + w for bb, wo, w in zip(base, want_o, want)]
    # floor (conftest rule 2): a few roundings of the result where SDPA happens to be exact
    ulp = 16 * torch.finfo(dtype).eps
    for name, g, w, bb in zip(("out", "dq", "dk", "dv"), got, want, base):
        assert g.dtype == dtype
        err = float((g.double() - w).abs().max())
        err_pt = float((bb.double() - w).abs().max())
        assert err <= 2 * err_pt + ulp * max(1.0, float(w.abs().max())), \
            f"{name}: ours {err:.3g} vs PyTorch {err_pt:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pattern", [LONGNET, DEFAULT, ODD, ALL, ALL_SLIDING],
                         ids=["longnet", "default", "odd", "all", "all_sliding"])
def test_fast_path_matches_reference(pattern, dtype):
    check(pattern, s=700 if pattern is LONGNET else 301, dtype=dtype)


@pytest.mark.parametrize("s", [1, 2, 63, 64, 65, 257])
def test_odd_lengths_and_partial_segments(s):
    check(LONGNET, b=1, hq=4, hkv=4, s=s, d=16)
    check(DEFAULT, b=1, hq=5, hkv=1, s=s, d=24)


def test_lse_gradient():
    """lse used by the loss: its gradient goes through the extra feature column."""
    check(ODD, b=1, s=150, lse_grad=True)
    check(DEFAULT, b=1, s=150, lse_grad=True)


def test_masked_tiles_in_several_query_blocks(monkeypatch):
    monkeypatch.setattr(tiles, "FAST_QUERY_BLOCK", 16)
    check(ODD, s=150, d=16)
    check(LONGNET, b=1, s=400, hq=12, hkv=3, d=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    check(DEFAULT, s=200, d=32, dtype=dtype)


@pytest.mark.parametrize("seed", range(8))
def test_random_patterns(seed):
    rng = random.Random(f"{torch.initial_seed()}-{seed}")  # fresh per run (conftest)
    s = rng.choice([50, 97, 160])
    pattern = random_pattern(rng, s, window=None, sinks=None, nested=True)
    a = check_inputs(*fresh(1, 4, 2, s, 8, torch.float32), pattern)
    fast = tiles.plan_whole(pattern, a, True, torch.zeros(1)) is not None
    check(pattern, b=1, hq=4, hkv=2, s=s, d=16, fast=fast)


def test_nested_config_on_the_other_classes():
    """(43, 2) nests in (86, 2), but its segment [43, 86) starts on an odd position, so its
    classes are the other parity: (86, 2) does not cover it (the plan once dropped it)."""
    check(DilatedPattern([44, 86, 43], [1, 2, 2], sink_tokens=3), b=2, hq=2, hkv=2, s=97, d=8)
    check(DilatedPattern([44, 86, 43], [1, 2, 2]), b=1, hq=4, hkv=1, s=130, d=8,
          dtype=torch.float64)


def test_left_to_the_blockwise_path():
    """Non-causal calls, positions other than 0..S-1 per document and sliding patterns whose
    earlier rates (in priority order: by rate, ``planning.priority``) do not divide later ones
    take the blockwise path (and stay exact)."""
    check(LONGNET, b=1, s=120, causal=False, fast=False)
    check(DilatedPattern([16, 24, 40], [1, 2, 3], window="sliding"), s=90, fast=False)
    # rates [2, 1] given in that order: rate 1 comes first in priority, so the tiles apply
    check(DilatedPattern([16, 40], [2, 1], window="sliding"), s=90, fast=True)
    q, k, v = fresh(2, 4, 2, 90, 16, torch.float32)
    for kw in ({"q_positions": torch.arange(90) + 7, "k_positions": torch.arange(90) + 7},
               {"q_doc_ids": torch.zeros(90, dtype=torch.long),  # a continued document
                "k_doc_ids": torch.zeros(90, dtype=torch.long),
                "q_positions": torch.arange(90) + 3, "k_positions": torch.arange(90) + 3}):
        a = check_inputs(q, k, v, DEFAULT, **kw)
        assert tiles.plan_whole(DEFAULT, a, True, q) is None
        assert not tiles.plan_documents(DEFAULT, a, True, q)
        got = dilated_attention(q, k, v, DEFAULT, backend="torch", **kw)
        # two float32 computations (chunked, dense): each within attention_tol of the exact
        assert_close("out", got, reference_attention(q, k, v, DEFAULT, **kw),
                     2 * attention_tol(90, 16))


@pytest.mark.parametrize("pattern", [LONGNET, DEFAULT], ids=["longnet", "default"])
def test_documents_and_padding(pattern):
    """Packed documents (positions restarting at 0) and padding (doc id -1) per batch row: one
    dense-tile call per document; padded queries output 0 with lse -inf."""
    lens = [[70, 3, 110, 17], [1, 150, 49]]  # row 1: one padding token first
    docs = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in
                         ([70, 3, 110, 17], [1, 150, 49])])
    docs[1, 0] = -1
    pos = torch.tensor([sum((list(range(n)) for n in row), []) for row in lens])
    q, k, v = fresh(2, 6, 2, 200, 24, torch.float64)
    kw = dict(q_positions=pos, k_positions=pos, q_doc_ids=docs, k_doc_ids=docs)
    runs = tiles.plan_documents(pattern, check_inputs(q, k, v, pattern, **kw), True, q)
    assert [(b, lo, hi) for b, lo, hi in runs] == [(0, 0, 70), (0, 70, 73), (0, 73, 183),
                                                    (0, 183, 200), (1, 1, 151), (1, 151, 200)]
    dout, dlse = torch.randn(2, 6, 200, 24, dtype=torch.float64), torch.randn(2, 6, 200,
                                                                              dtype=torch.float64)
    dlse[1, :, 0] = 0  # the padded query's lse is -inf
    got = grads(lambda q, k, v: dilated_attention(q, k, v, pattern, backend="torch",
                                                  return_lse=True, **kw), q, k, v, dout, dlse)
    want = grads(lambda q, k, v: reference_attention(q, k, v, pattern, return_lse=True,
                                                     dtype=torch.float64, **kw),
                 q, k, v, dout, dlse)
    # float64, but lse comes back as float32 (its gradient too): one rounding of |lse|, carried
    # by terms of randn size into the gradients
    lse = reference_attention(q, k, v, pattern, return_lse=True, dtype=torch.float64, **kw)[1]
    tol = lse_float32_tol(float(lse[torch.isfinite(lse)].abs().max())) * RANDN_MAX
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, g, w, tol)
    assert float(got[0][1, :, 0].abs().max()) == 0.0


def test_plan_is_cached():
    q, k, v = fresh(1, 4, 2, 77, 8, torch.float32)
    a = check_inputs(q, k, v, DEFAULT)
    assert tiles.plan_whole(DEFAULT, a, True, q) is tiles.plan_whole(DEFAULT, a, True, q)


def test_cpu_benchmark_smoke(tmp_path):
    from hf_hilbert_attn.tools.benchmarks import cpu

    rows = cpu.main(["--lengths", "64", "96", "--shapes", "4/2x16", "--patterns", "longnet_lm",
                     "default", "--repeats", "1", "--backward", "--out", str(tmp_path)])
    assert len(rows) == 4
    with open(next(tmp_path.glob("*.csv"))) as f:
        got = list(csv.DictReader(f))
    assert [r["pattern"] for r in got] == ["longnet_lm", "longnet_lm", "default", "default"]
    assert all(float(r["fwd_ratio"]) > 0 and float(r["fwdbwd_ratio"]) > 0 for r in got)
    assert "| longnet_lm |" in next(tmp_path.glob("*.md")).read_text()
