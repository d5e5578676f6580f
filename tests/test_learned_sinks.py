"""Learned attention sinks (gpt-oss ``s_aux``: one logit per head that joins every softmax
denominator with no value): the attention with them is the attention without them rescaled by
``sigmoid(lse - sink)`` (``numerics.with_sink_logits``), on every path that gives an lse: the
kernels, the PyTorch engines, the ring, a PatternCache's dropped-key layout."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from conftest import model_tol
from hf_hilbert_attn import DilatedPattern, PatternCache, configure, get_pattern
from hf_hilbert_attn.integrations.cache import cache_kwarg
from hf_hilbert_attn.numerics import with_sink_logits
from test_layer_types import dense_as_before, logits_under
from test_transformers import (DENSE, SMALL, VOCAB, assert_rel_close, left_pad_mask,
                               loss_logits_grads, tokens)

WINDOW = 8


def _explicit(q, k, v, mask, sinks, scale):
    """Softmax over the allowed scores and one more column, the sink logit, whose value is 0."""
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    return p @ v.repeat_interleave(group, 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sink_logits_are_a_softmax_column_with_no_value(backend, monkeypatch):
    """Outputs and the gradients of q, k, v and the sink logits (float32) equal a softmax with
    one more column (float64), under a sparse pattern with GQA, padded keys and rows with no
    key (the op's lse is float32 whatever the inputs: float32 is what it can be held to)."""
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dtype = torch.float32
    pattern = DilatedPattern([4, 8], [1, 2], sink_tokens=1)
    q = torch.randn(2, 4, 19, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 19, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 19, 16, dtype=dtype, requires_grad=True)
    sinks = torch.randn(4, dtype=dtype, requires_grad=True)
    docs = torch.zeros(2, 19, dtype=torch.long)
    docs[1, :3] = -1  # padding: row 1's first three tokens attend nothing
    kw = dict(q_doc_ids=docs, k_doc_ids=docs)
    from hf_hilbert_attn import dilated_attention

    out, lse = dilated_attention(q, k, v, pattern, return_lse=True, backend=backend, **kw)
    got = with_sink_logits(out, lse, sinks.view(1, -1, 1))
    mask = pattern.build_mask(4, torch.arange(19), torch.arange(19), q_doc_ids=docs,
                              k_doc_ids=docs, num_kv_heads=2)
    want = _explicit(*(t.double() for t in (q, k, v)), mask, sinks.double(), 16 ** -0.5)
    g = torch.randn_like(want)
    grads = torch.autograd.grad((got * g.to(dtype)).sum(), (q, k, v, sinks))
    wants = torch.autograd.grad((want * g).sum(), (q, k, v, sinks))
    tol = model_tol(19, 19, 16)  # rows of <= 19 keys, 16 features, float32 sums
    assert_rel_close(got.double(), want, rel=tol, what="out")
    assert torch.equal(got[1, :, :3], torch.zeros_like(got[1, :, :3]))  # no key: 0
    for name, a, b in zip("q k v sinks".split(), grads, wants):
        assert_rel_close(a.double(), b, rel=tol, what=f"d{name}")


def tiny_gpt_oss(attn="eager"):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, head_dim=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, sliding_window=WINDOW,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks that matter: the zero init would hide them
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.eval()


def test_gpt_oss_with_the_dense_pattern_is_its_eager_attention():
    """gpt-oss (learned sinks in every layer, alternate layers on a sliding window): logits, loss
    and every gradient, the sinks' included, equal its eager attention's; so do greedy tokens
    with a left-padded batch and with a PatternCache; the sinks matter."""
    model = tiny_gpt_oss()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ids = tokens(2, 40)
    _, got = dense_as_before(model, ids)
    assert any("sinks" in n for n in got[2]) and all(
        got[2][n].abs().max() > 0 for n in got[2] if "sinks" in n)
    generates_as_eager(model, ids, 2 * WINDOW)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nothing attends: plain attention
        without = model(ids).logits
    assert (without - got[1]).abs().max() > 1e-3 * got[1].abs().max()


def generates_as_eager(model, ids, steps: int):
    """Greedy tokens of ``model`` (``hilbert_dilated``) with a left-padded batch and with a
    PatternCache equal its eager attention's."""
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    mask = left_pad_mask(ids.shape[0], ids.shape[1], [0, 5])
    for extra in (dict(attention_mask=mask), {cache_kwarg(model): PatternCache(model)}):
        ours = model.generate(ids, **extra, **kw)
        model.set_attn_implementation("eager")
        theirs = model.generate(ids, **{k: v for k, v in extra.items() if k == "attention_mask"},
                                **kw)
        model.set_attn_implementation("hilbert_dilated")
        assert torch.equal(ours, theirs), extra.keys()


def sparse_as_reference(model, ids, reference: str) -> PatternCache:
    """With a sparse pattern configured: the logits equal those of the attention registered as
    ``reference`` and differ from eager's (the pattern matters); a PatternCache's greedy run of 40
    tokens equals the full cache's, step by step. Returns the PatternCache."""
    got, want, dense = logits_under(model, ids, "hilbert_dilated", reference, "eager")
    assert_rel_close(got, want, what="logits vs the reference")
    assert (got - dense).abs().max() > 1e-3 * dense.abs().max()
    model.set_attn_implementation("hilbert_dilated")
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    cache = PatternCache(model)
    bounded = model.generate(ids, **{cache_kwarg(model): cache}, **kw)
    full = model.generate(ids, **kw)
    assert torch.equal(bounded.sequences, full.sequences)
    for t, (a, b) in enumerate(zip(bounded.logits, full.logits)):
        assert_rel_close(a, b, rel=model_tol(80, 80, 16), what=f"step {t}")
    return cache


def _reference_with_sinks(module, query, key, value, attention_mask, scaling=None,
                          dropout=0.0, s_aux=None, **kwargs):
    pattern = get_pattern(module.config, module.layer_idx)
    n = query.shape[2]
    mask = pattern.build_mask(query.shape[1], torch.arange(n), torch.arange(n),
                              num_kv_heads=key.shape[1])
    return _explicit(query, key, value, mask, s_aux, scaling).transpose(1, 2), None


def test_gpt_oss_with_a_sparse_pattern_equals_the_reference():
    """With a sparse pattern on the full-attention layers (the window on the others), the model
    equals one whose layers run the explicit softmax with the sink column over each layer's
    pattern (``get_pattern(config, layer)``)."""
    AttentionInterface.register("hilbert_sinks_reference_test", _reference_with_sinks)
    model = configure(tiny_gpt_oss(), SMALL)
    cache = sparse_as_reference(model, tokens(2, 40), "hilbert_sinks_reference_test")
    # a PatternCache drops keys in every layer (the dropped-key layout gives its lse too)
    assert all(layer.dropped > 0 for layer in cache.layers)


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_transformers")  # one worker compiles the kernels both use
def test_gpu_gpt_oss_matches_eager():
    """On the GPU (the kernels give out and lse, the sinks rescale them): with the dense pattern,
    logits and gradients as eager's, within TF32 rounding; greedy tokens equal."""
    gpu_dense_as_eager(tiny_gpt_oss().cuda(), 2 * WINDOW)


def gpu_dense_as_eager(model, steps: int, caches=(None,)):
    """On the GPU, ``model`` with the dense pattern: logits and gradients as its eager
    attention's within TF32 rounding; greedy tokens (``steps``, with each cache factory of
    ``caches``, None: the default cache) as eager's."""
    from conftest import eps

    ids = tokens(2, 40).cuda()
    ref = loss_logits_grads(model, ids)
    configure(model, DENSE)
    got = loss_logits_grads(model, ids)
    # Triton may use TF32 for float32 dots: a rounding of each input (eps(tf32)/2) per dot,
    # through ~6 dots per logit, twice as many per gradient (conftest.EPS)
    assert_rel_close(got[1], ref[1], rel=10 * eps("tf32"), what="logits")
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], rel=20 * eps("tf32"), what=f"grad {name}")
    kw = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    ours = [model.generate(ids, **({} if c is None else {cache_kwarg(model): c(model)}), **kw)
            for c in caches]
    model.set_attn_implementation("eager")
    theirs = model.generate(ids, **kw)
    assert all(torch.equal(o, theirs) for o in ours)
