"""Models of the fine-tune and the benchmarks: the shapes of their random-initialised Llamas,
regional compilation, and a causal LM with its loss in one module."""

from __future__ import annotations

from typing import Dict

import torch

from hf_hilbert_attn.sharding import shift_labels as _shift  # forward's argument has the name
from hf_hilbert_attn.training import lm_loss

__all__ = ["MODEL_SHAPES", "compile_layers", "CausalLMWithLoss"]

# LlamaConfig fields of the random-initialised models the benchmark and the fine-tune build.
MODEL_SHAPES: Dict[str, Dict] = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads x 64, 8 KV heads, vocab 128256
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads x 64, 3 KV heads, vocab 49152 (the quality
    # study's model; short sequences, small heads)
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                 vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    # a CPU smoke-test model: milliseconds per step
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=256, rope_theta=10000.0, tie_word_embeddings=False),
}


def compile_layers(model) -> int:
    """``torch.compile`` each decoder layer in place (regional compilation: one graph per layer
    type, compiled once and reused by every layer), for any attention implementation; the
    attention op stays opaque inside the graph (a custom op for ``hilbert_dilated``). Returns
    the number of layers compiled."""
    base = getattr(model, model.base_model_prefix)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise ValueError(f"compile_layers: no decoder layers found on {type(base).__name__}")
    for layer in layers:
        layer.compile()
    return len(layers)


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM plus its loss in one module, so DDP sees the whole step.

    ``loss_chunk > 0`` computes the cross-entropy from the final hidden states ``loss_chunk``
    positions at a time (:func:`hf_hilbert_attn.training.chunked_lm_loss`): at long context the
    full ``[S, vocab]`` float32 logits would otherwise dominate memory (128K tokens x 128K
    vocabulary = 64 GiB). ``loss_backend`` picks :func:`hf_hilbert_attn.training.lm_loss`'s
    backend (``"liger"``: Liger-Kernel's fused linear cross-entropy on CUDA; ``"auto"``: Liger
    where installed on CUDA).
    It assumes ``logits = lm_head(hidden)`` (Llama, Qwen2, Mistral, GPT-2); models that scale
    or soft-cap logits are refused.
    """

    def __init__(self, lm, loss_chunk: int = 0, loss_backend: str = "chunked"):
        super().__init__()
        self.lm = lm
        self.loss_chunk = int(loss_chunk)
        self.loss_backend = loss_backend
        cfg = lm.config
        if self.loss_chunk and (getattr(cfg, "final_logit_softcapping", None)
                                or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0)):
            raise ValueError(f"--loss-chunk: {type(lm).__name__} transforms its logits "
                             "(soft-capping or scaling); use --loss-chunk 0")

    def forward(self, labels=None, shift_labels=None, num_items_in_batch=None, **inputs):
        if not self.loss_chunk:
            return self.lm(labels=labels, shift_labels=shift_labels,
                           num_items_in_batch=num_items_in_batch, use_cache=False, **inputs).loss
        base = getattr(self.lm, self.lm.base_model_prefix)
        hidden = base(use_cache=False, **inputs).last_hidden_state
        y = shift_labels if shift_labels is not None else _shift(labels)
        return lm_loss(hidden, self.lm.get_output_embeddings().weight, y, self.loss_chunk,
                       num_items=num_items_in_batch, backend=self.loss_backend)
