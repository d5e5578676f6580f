"""Training helpers shared by the fine-tune example (``examples/finetune.py``) and the model
benchmark (:mod:`hf_hilbert_attn.tools.evaluation.bench_model`): model shapes, activation
checkpointing, and a next-token loss that never materialises the whole ``[S, vocab]`` logits.
"""

from __future__ import annotations

import importlib.util
from typing import Dict

import torch
import torch.nn.functional as F

from .sharding import shift_labels as _shift  # forward's argument has the name

__all__ = ["MODEL_SHAPES", "enable_checkpointing", "chunked_lm_loss", "lm_loss", "liger_available",
           "LOSS_BACKENDS", "CausalLMWithLoss"]

LOSS_BACKENDS = ("auto", "liger", "chunked")

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


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer. transformers >= 5.2x
    renamed the method (the old name warns); 5.17 has only the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk: int = 2048, num_items=None) -> torch.Tensor:
    """Mean next-token cross-entropy from hidden states, ``chunk`` positions at a time.

    Args:
        hidden: ``[B, S, H]`` final hidden states (after the final norm).
        weight: ``[V, H]`` the LM head.
        labels: ``[B, S]``, ``labels[:, t]`` is the target of position ``t`` (already shifted;
            -100 = ignored).
        chunk: positions per chunk; each chunk's ``[chunk, V]`` logits live only inside it
            (recomputed in backward by activation checkpointing).
        num_items: divide the summed loss by this instead of the number of non-ignored labels
            here (a sequence-parallel shard divides by the count over the whole sequence).

    Returns:
        The scalar mean loss over non-ignored labels (float32), or ``sum / num_items``.
    """
    from torch.utils.checkpoint import checkpoint

    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = (y != -100).sum().clamp(min=1) if num_items is None else num_items

    acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits → float32 softmax

    def piece(hc, yc):
        return F.cross_entropy((hc @ weight.t()).to(acc), yc, ignore_index=-100, reduction="sum")

    total = hidden.new_zeros((), dtype=acc)
    for i in range(0, h.shape[0], chunk):
        total = total + checkpoint(piece, h[i:i + chunk], y[i:i + chunk], use_reentrant=False)
    return total / n


def liger_available() -> bool:
    """Liger-Kernel (``pip install liger-kernel``) is importable."""
    return importlib.util.find_spec("liger_kernel") is not None


def _liger_loss(hidden, weight, labels, num_items=None):
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    y = labels.reshape(-1)
    n = (y != -100).sum().clamp(min=1) if num_items is None else num_items
    # Sum, then divide, so a sequence-parallel shard can divide by the global count; the
    # weight gradient accumulated in float32 as chunked_lm_loss's GEMMs do.
    total = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum",
                                             accum_dtype=torch.float32)(weight, h, y)
    return total.to(torch.promote_types(total.dtype, torch.float32)) / n


def lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 2048,
            num_items=None, backend: str = "auto") -> torch.Tensor:
    """Mean next-token cross-entropy from the final hidden states, never the whole logits.

    ``backend``: ``"liger"`` — Liger-Kernel's fused linear cross-entropy (CUDA only; computes
    the gradients chunk by chunk during the forward); ``"chunked"`` —
    :func:`chunked_lm_loss` with ``chunk`` positions at a time;
    ``"auto"`` — Liger where installed and ``hidden`` is on CUDA, else chunked. Arguments and
    result as :func:`chunked_lm_loss` (a float32 scalar).
    """
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"loss backend must be one of {', '.join(LOSS_BACKENDS)}, got {backend!r}")
    if backend == "liger":
        if hidden.device.type != "cuda":
            raise ValueError(f"loss backend 'liger' needs a CUDA device, got {hidden.device.type}")
        if not liger_available():
            raise ImportError("loss backend 'liger' needs Liger-Kernel: pip install liger-kernel")
    if backend == "liger" or (backend == "auto" and hidden.device.type == "cuda"
                              and liger_available()):
        return _liger_loss(hidden, weight, labels, num_items)
    return chunked_lm_loss(hidden, weight, labels, chunk, num_items=num_items)


class CausalLMWithLoss(torch.nn.Module):
    """A causal LM plus its loss in one module, so DDP sees the whole step.

    ``loss_chunk > 0`` computes the cross-entropy from the final hidden states ``loss_chunk``
    positions at a time (:func:`chunked_lm_loss`): at long context the full ``[S, vocab]``
    float32 logits would otherwise dominate memory (128K tokens x 128K vocabulary = 64 GiB).
    ``loss_backend`` picks :func:`lm_loss`'s backend (``"liger"``:
    Liger-Kernel's fused linear cross-entropy on CUDA; ``"auto"``: Liger where installed on CUDA).
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
