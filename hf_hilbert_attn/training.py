"""Training helpers: activation checkpointing, and a next-token loss that never materialises
the whole ``[S, vocab]`` logits."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["enable_checkpointing", "chunked_lm_loss", "lm_loss", "liger_available",
           "LOSS_BACKENDS"]

LOSS_BACKENDS = ("auto", "liger", "chunked")


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer. transformers >= 5.2x
    renamed the method (the old name warns); 5.17 has only the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk: int = 2048, num_items=None) -> torch.Tensor:
    """Mean next-token cross-entropy from hidden states, ``chunk`` positions at a time.

    ``hidden`` ``[B, S, H]``: final hidden states (after the final norm); ``weight`` ``[V, H]``:
    the LM head; ``labels`` ``[B, S]``: ``labels[:, t]`` the target of position ``t`` (already
    shifted; -100 = ignored); ``chunk``: positions per chunk (its ``[chunk, V]`` logits are
    recomputed in the backward); ``num_items``: divide the summed loss by this instead of the
    non-ignored labels here (a sequence-parallel shard: by the whole sequence's count).
    Returns the scalar mean loss over non-ignored labels (float32), or ``sum / num_items``.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = (y != -100).sum().clamp(min=1) if num_items is None else num_items

    acc = torch.promote_types(hidden.dtype, torch.float32)  # bf16 logits → float32 softmax

    def piece(hc, yc):
        return F.cross_entropy((hc @ weight.t()).to(acc), yc, ignore_index=-100, reduction="sum")

    return sum((checkpoint(piece, h[i:i + chunk], y[i:i + chunk], use_reentrant=False)
                for i in range(0, h.shape[0], chunk)), hidden.new_zeros((), dtype=acc)) / n


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

    ``backend``: ``"liger"`` (Liger-Kernel's fused linear cross-entropy, CUDA only: gradients
    chunk by chunk during the forward), ``"chunked"`` (:func:`chunked_lm_loss`) or ``"auto"``
    (Liger where installed and on CUDA, else chunked). Arguments and result as
    :func:`chunked_lm_loss` (a float32 scalar).
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
