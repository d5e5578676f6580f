"""Small numeric helpers shared by the attention paths (PyTorch path, ring, reference)."""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch

__all__ = ["accum_dtype", "finite_or_zero", "merge_partials", "merge_into", "with_sink_logits",
           "autocast_inputs", "autocast_off"]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 where the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row with no allowed key) replaced by 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys ``A ∪ B`` from the results over ``A`` and over ``B``: ``out_*``
    ``[..., S, D]``, ``lse_*`` ``[..., S]`` (natural log; an empty row is ``(0, -inf)`` and
    stays so). ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b -
    lse) out_b``, in the inputs' dtype (pass :func:`accum_dtype` tensors).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = finite_or_zero(lse)
    return (out_a * torch.exp(lse_a - ref).unsqueeze(-1)
            + out_b * torch.exp(lse_b - ref).unsqueeze(-1)), lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
               lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` in place: ``(out, lse)`` becomes the merge of itself and ``(out_b,
    lse_b)`` (over other keys), in its own dtypes; returns it."""
    new = torch.logaddexp(lse, lse_b.to(lse.dtype))
    ref = finite_or_zero(new)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).addcmul_(out_b.to(out.dtype),
                                                          torch.exp(lse_b - ref).unsqueeze(-1))
    return out, lse.copy_(new)


def with_sink_logits(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax denominator also holds a learned logit per row and no value
    (gpt-oss' ``s_aux``, one per head; or one per query): ``out`` ``[B, H, S, D]`` and ``lse``
    ``[B, H, S]`` of the attention without it, ``sinks`` broadcastable to ``lse``. Exactly
    ``out · exp(lse) / (exp(lse) + exp(sink)) = out · sigmoid(lse - sink)`` (a row with no
    allowed key stays 0), differentiable in all three."""
    dt = accum_dtype(out.dtype)
    return out * torch.sigmoid(lse.to(dt) - sinks.to(dt)).unsqueeze(-1).to(out.dtype)


def autocast_inputs(q, k, v) -> tuple:
    """``(q, k, v)`` as SDPA computes with them under ``torch.autocast``: cast to the autocast
    dtype (float64 tensors stay float64, as autocast leaves them); unchanged where autocast is
    not on for ``q``'s device.

    Mixed precision is where q, k, v disagree (Llama's rotary embedding multiplies bf16 q/k by
    float32 cos/sin, and elementwise ops are not autocast, so q and k arrive in float32 next to
    a bf16 v). Outside autocast nothing is cast (mixed dtypes then raise in ``check_inputs``).
    """
    dev = q.device.type if isinstance(q, torch.Tensor) else None
    if dev not in ("cuda", "cpu", "xpu") or not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype not in (dt, torch.float64) else t for t in (q, k, v))


def autocast_off(t):
    """A context in which ``torch.autocast`` is off for ``t``'s device where it is on (the op
    computes with its inputs cast once by :func:`autocast_inputs`, as SDPA does), else a no-op."""
    dev = t.device.type if isinstance(t, torch.Tensor) else None
    on = dev in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(dev)
    return torch.autocast(dev, enabled=False) if on else contextlib.nullcontext()
