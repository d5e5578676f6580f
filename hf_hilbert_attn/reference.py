"""Ground truth: ``reference_attention``, dense masked softmax in float32 or float64, from the
full ``[B, H, Sq, Sk]`` mask of ``pattern.py``: O(Sq*Sk), for tests and benchmarks only.
"""

from __future__ import annotations

from typing import Optional

import torch

from .inputs import check_inputs
from .numerics import finite_or_zero
from .pattern import DilatedPattern


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: DilatedPattern,
                        *, causal: bool = True, scale: Optional[float] = None,
                        q_positions: Optional[torch.Tensor] = None,
                        k_positions: Optional[torch.Tensor] = None,
                        q_doc_ids: Optional[torch.Tensor] = None,
                        k_doc_ids: Optional[torch.Tensor] = None, return_lse: bool = False,
                        softcap: Optional[float] = None, dtype: torch.dtype = torch.float32):
    """Dense masked attention of the dilated pattern (same arguments as ``dilated_attention``).

    Returns ``out`` ``[B, Hq, Sq, D]`` in ``dtype`` (float32 or float64), and with
    ``return_lse=True`` also ``lse`` ``[B, Hq, Sq]`` (natural log; ``-inf`` for a query with no
    allowed key, whose output is 0). Differentiable with respect to q, k, v.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"reference dtype must be float32 or float64, got {dtype}")
    a = check_inputs(q, k, v, pattern, scale=scale, q_positions=q_positions,
                     k_positions=k_positions, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                     softcap=softcap)
    mask = pattern.build_mask(a.hq, a.q_positions, a.k_positions, causal=causal,
                              q_doc_ids=a.q_doc_ids, k_doc_ids=a.k_doc_ids,
                              num_kv_heads=a.hkv)  # [B', Hq, Sq, Sk]
    kf, vf = (t.to(dtype).repeat_interleave(a.hq // a.hkv, dim=1) for t in (k, v))
    scores = torch.matmul(q.to(dtype), kf.transpose(-1, -2)) * a.scale
    scores = torch.tanh(scores / a.softcap) * a.softcap if a.softcap else scores
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where the row is empty
    p = torch.exp(scores - finite_or_zero(lse).unsqueeze(-1))  # exp(-inf) = 0: masked / empty rows
    out = torch.matmul(p, vf)
    return (out, lse) if return_lse else out
