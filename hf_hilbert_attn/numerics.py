"""Small numeric helpers shared by the attention paths (PyTorch path, ring, reference).

* :func:`accum_dtype` — the dtype partial results accumulate in: float32, or float64 for
  float64 inputs (so float64 stays float64 end to end).
* :func:`finite_or_zero` — ``-inf`` replaced by 0, the shift used before ``exp`` so a row with
  no allowed key gives 0 rather than NaN.
* :func:`merge_partials` — two partial attention results ``(out, lse)`` over disjoint key sets
  merged into the result over their union.
* :func:`call_under_autocast` — SDPA's autocast behaviour: cast q, k, v to the autocast dtype
  and call with autocast off.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

__all__ = ["accum_dtype", "finite_or_zero", "merge_partials", "autocast_dtype",
           "cast_for_autocast", "call_under_autocast"]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 where the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row with no allowed key) replaced by 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys ``A ∪ B`` from the results over ``A`` and over ``B``.

    ``out_*`` ``[..., S, D]`` and ``lse_*`` ``[..., S]`` (natural log, ``-inf`` for an empty
    row, whose ``out`` is 0). ``lse = logaddexp(lse_a, lse_b)`` and
    ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``; a row empty in both stays
    ``(0, -inf)``. Computed in the inputs' dtype (pass :func:`accum_dtype` tensors).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = finite_or_zero(lse)
    out = (out_a * torch.exp(lse_a - ref).unsqueeze(-1)
           + out_b * torch.exp(lse_b - ref).unsqueeze(-1))
    return out, lse


def autocast_dtype(q) -> Optional[torch.dtype]:
    """The autocast dtype when ``torch.autocast`` is on for ``q``'s device, else None.

    Under autocast the attention runs in that dtype, as SDPA does: mixed precision is where
    q, k, v disagree (Llama's rotary embedding multiplies bf16 q/k by float32 cos/sin, and
    elementwise ops are not autocast, so q and k arrive in float32 next to a bf16 v). Callers
    cast with :func:`cast_for_autocast` and compute with autocast off; outside autocast nothing
    is cast (mixed dtypes then raise in ``check_inputs``).
    """
    dev = q.device.type if isinstance(q, torch.Tensor) else None
    if dev in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def cast_for_autocast(dtype, *tensors):
    """``tensors`` in ``dtype`` (float64 and non-floating tensors are left alone, as autocast
    leaves float64)."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 and t.dtype != torch.float64 else t for t in tensors)


def call_under_autocast(fn: Callable, q, k, v, *args, **kwargs):
    """Under ``torch.autocast``: ``fn(q, k, v, *args, **kwargs)`` with q, k, v cast to the
    autocast dtype and autocast off; None when autocast is not on for ``q``'s device."""
    dt = autocast_dtype(q)
    if dt is None:
        return None
    with torch.autocast(q.device.type, enabled=False):
        return fn(*cast_for_autocast(dt, q, k, v), *args, **kwargs)
