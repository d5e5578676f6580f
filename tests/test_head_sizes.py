"""Head sizes the kernels do not take (MLA's query/key 192 with value 128, Phi's 80 or 96): on a
GPU the attention layer pads q, k, v with zeros to the next size the kernels take
(``inputs.kernel_widths``), which leaves the scores and the output's first ``Dv`` features
exactly as they were."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import attention_tol, eps
from hf_hilbert_attn import DilatedPattern, configure, dilated_attention, reference_attention
from hf_hilbert_attn import ops
from hf_hilbert_attn.inputs import KERNEL_HEAD_DIMS, kernel_widths
from test_transformers import DENSE, SMALL, VOCAB, assert_rel_close, loss_logits_grads, tokens


@pytest.mark.parametrize("d,dv", [(24, 16), (80, 80), (96, 64), (192, 128)])
def test_zero_padding_leaves_the_attention_and_its_gradients(d, dv):
    """Padded to the kernels' next size, attended and cut back to ``Dv``: the reference's output
    and gradients of the unpadded q, k, v (float64), under a sparse pattern with GQA."""
    pattern = DilatedPattern([4, 8], [1, 2], window="sliding", sink_tokens=1)
    q = torch.randn(2, 4, 21, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 21, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 21, dv, dtype=torch.float64, requires_grad=True)
    pq, pk, pv, scale, width = kernel_widths(q, k, v, None, kernels=True)
    assert width == dv and pq.shape[-1] == pv.shape[-1] in KERNEL_HEAD_DIMS
    assert pq.shape[-1] >= max(d, dv) and scale == d ** -0.5
    got = dilated_attention(pq, pk, pv, pattern, scale=scale, backend="torch")[..., :dv]
    want = reference_attention(q, k, v, pattern, dtype=torch.float64)
    g = torch.randn_like(want)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v))
    wants = torch.autograd.grad((want * g).sum(), (q, k, v))
    for name, a, b in zip(["out", "dq", "dk", "dv"], (got, *grads), (want, *wants)):
        # float64 sums in another order (blocks, padding): conftest.attention_tol
        assert_rel_close(a, b, rel=attention_tol(21, pq.shape[-1], "float64"), what=name)
    # sizes the kernels take, and CPU tensors by default, are left as they are
    same = torch.randn(1, 2, 5, 64)
    assert kernel_widths(same, same, same, None, kernels=True)[0] is same
    assert kernel_widths(q, k, v, 0.5)[:4] == (q, k, v, 0.5)


def tiny(family: str, attn: str = "sdpa"):
    sizes = dict(  # DeepSeek-V3: query/key 8 + 16 = 24 features, value 16 (MLA)
        deepseek_v3=dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_group=1, topk_group=1, num_key_value_heads=4),
        phi3=dict(num_key_value_heads=2))[family]  # Phi-3: 4 heads of 96 (hidden 384)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=384 if family == "phi3" else 64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **sizes)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                            dtype=torch.float32).eval()


@pytest.mark.gpu  # (each its own unit: 55 / 32 s of the cold suite, tests/conftest.py)
@pytest.mark.parametrize("family", ["deepseek_v3", "phi3"])
def test_gpu_head_sizes_the_kernels_lack_run_on_them(family, monkeypatch):
    """On the GPU such a model runs the kernels (the PyTorch path is not called), with the
    dense pattern as sdpa within TF32 rounding (logits, every gradient; greedy tokens), and a
    sparse pattern trains."""
    model = tiny(family).cuda()
    ids = tokens(2, 40).cuda()
    ref = loss_logits_grads(model, ids)
    configure(model, DENSE)
    monkeypatch.setattr(ops, "chunked_attention", None)  # the PyTorch path would raise
    got = loss_logits_grads(model, ids)
    # Triton may use TF32 for float32 dots (conftest.EPS): ~6 dots per logit, twice as many
    # per gradient
    assert_rel_close(got[1], ref[1], rel=10 * eps("tf32"), what="logits")
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], rel=20 * eps("tf32"), what=f"grad {name}")
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = model.generate(ids, **kw)
    model.set_attn_implementation("sdpa")
    assert torch.equal(ours, model.generate(ids, **kw))
    # (Phi-3: one config, whose kernels compile in a fraction of the union launches' time in
    # float32 at head size 128: the cold GPU suite's longest unit, tests/conftest.py)
    configure(model, SMALL if family != "phi3" else DilatedPattern([8], [1]))
    loss, logits, grads = loss_logits_grads(model, ids)
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
