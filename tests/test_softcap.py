"""Soft-capped attention scores (Gemma 2's ``attn_logit_softcapping``: every scaled score ``s``
taken as ``cap * tanh(s / cap)`` before the softmax) on every path: the PyTorch engines here,
the kernels in ``test_kernels.py`` / ``test_decode.py`` (interpreter) and
``test_kernels_gpu.py``, the ring and Ulysses in ``test_ring.py``; and Gemma 2 models."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from conftest import RANDN_MAX, attention_tol
from helpers import assert_close
from hf_hilbert_attn import (DilatedPattern, PatternCache, configure, dilated_attention,
                             get_pattern, reference_attention)
from test_layer_types import dense_as_before
from test_learned_sinks import generates_as_eager, gpu_dense_as_eager, sparse_as_reference
from test_transformers import SMALL, VOCAB, tokens

CAP = 1.5  # moves the scores of randn inputs by up to several units


@pytest.mark.parametrize("pattern,causal", [
    (DilatedPattern([8, 16, 32], [1, 2, 4], sink_tokens=2), True),
    (DilatedPattern([8, 16], [1, 2], window="sliding", query_dilation="all"), False),
    (DilatedPattern([12, 20], [1, 3], dense_kv_heads=[1]), True)])  # a second, dense call
def test_the_pytorch_path_caps_scores_as_the_reference(pattern, causal):
    """out, lse, dq, dk, dv (float32) against the float64 reference, GQA, padding, documents."""
    doc = torch.tensor([0] * 20 + [1] * 20 + [-1] * 5)
    q = torch.randn(2, 4, 45, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 45, 16, requires_grad=True) for _ in range(2))
    kw = dict(causal=causal, q_doc_ids=doc, k_doc_ids=doc, return_lse=True, softcap=CAP)
    out, lse = dilated_attention(q, k, v, pattern, backend="torch", **kw)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference_attention(qd, kd, vd, pattern, dtype=torch.float64, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), (qd, kd, vd))
    tol = attention_tol(45, 16)
    assert_close("out", out, ref, tol, elementwise=True)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close("lse", lse[finite], ref_lse[finite], tol, elementwise=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, tol * RANDN_MAX, elementwise=True)
    plain = reference_attention(qd, kd, vd, pattern, dtype=torch.float64, **{
        **kw, "softcap": None})[0]
    assert (plain - ref).abs().max() > 0.1  # the cap matters here


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), "50", True])
def test_a_bad_softcap_is_refused(cap):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        dilated_attention(q, q, q, SMALL, softcap=cap)


WINDOW = 8


def tiny_gemma2(attn="eager", family="gemma2"):
    """Gemma 2 (alternate layers on a sliding window, soft-capped scores, the scale from
    ``query_pre_attn_scalar``) with a cap low enough to matter on random weights."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=64, intermediate_size=64, head_dim=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=32,
        attn_logit_softcapping=CAP, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():  # scores of a few units: the cap bends them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model.eval()


@pytest.mark.parametrize("family", ["gemma2", "vaultgemma"])
def test_gemma2_with_the_dense_pattern_is_its_eager_attention(family):
    """Logits, loss and every gradient equal its eager attention's; so do greedy tokens with a
    left-padded batch and with a PatternCache; without the cap they would not (Gemma 2)."""
    model = tiny_gemma2(family=family)
    if family == "gemma2":
        assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    ids = tokens(2, 40)
    _, got = dense_as_before(model, ids)
    generates_as_eager(model, ids, 2 * WINDOW)
    if family != "gemma2":  # (the same attention; its tiny random model is nearly linear)
        return
    model.config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        uncapped = model(ids).logits
    assert (uncapped - got[1]).abs().max() > 1e-3 * got[1].abs().max()


def _reference_capped(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      softcap=None, **kwargs):
    # Each layer's pattern by the config, as the dense float32 reference with the cap.
    pattern = get_pattern(module.config, module.layer_idx)
    return reference_attention(query, key, value, pattern, scale=scaling,
                               softcap=softcap).transpose(1, 2), None


def test_gemma2_with_a_sparse_pattern_equals_the_reference():
    """With a sparse pattern on the full-attention layer (the window on the other), the model
    equals one whose layers run the capped reference of ``get_pattern(config, layer)``; a
    PatternCache's generation (dropped keys in every layer) equals the full cache's."""
    AttentionInterface.register("hilbert_softcap_reference_test", _reference_capped)
    model = configure(tiny_gemma2(), SMALL.replace(sink_tokens=2))  # (a cache's sink part)
    cache = sparse_as_reference(model, tokens(2, 40), "hilbert_softcap_reference_test")
    assert any(layer.dropped > 0 for layer in cache.layers)


@pytest.mark.gpu
@pytest.mark.xdist_group("gpu_transformers")  # one worker compiles the kernels both use
def test_gpu_gemma2_matches_eager():
    """On the GPU (the kernels cap the scores, the decode kernel too): with the dense pattern,
    logits and gradients as eager's within TF32 rounding; greedy tokens equal, with the
    DynamicCache and with a PatternCache."""
    gpu_dense_as_eager(tiny_gemma2().cuda(), 2 * WINDOW, caches=(None, PatternCache))
