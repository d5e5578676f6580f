"""Dense key/value heads (``DilatedPattern.dense_kv_heads``) where a call splits them off.

The query heads ``h`` (reading key/value head ``h // (Hq // Hkv)``) of a dense key/value head
attend every key. The kernels run them as launches of the same call (``kernels.dilated_fwd``);
elsewhere (the PyTorch path, packed documents, the ring across ranks) a call with dense heads
is two calls of a function that knows nothing of them:

* the sparse pattern (``pattern.sparse_part``) over **all** heads (per_head classes are ``h % r``
  of the absolute head index); the dense heads' share is discarded and the call told so
  (``_skip_kv_heads``): the kernels skip those heads (short calls: where that adds no launch);
* the one-config pattern ``[(2**30, 1)]`` (plain attention: SDPA where nothing else applies)
  over the dense heads' slice, whose result replaces theirs.

Autograd routes each head's gradient to the call whose output it kept.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .pattern import DilatedPattern

# Plain attention for any position below 2**30 (the kernels' position limit).
DENSE = DilatedPattern([1 << 30], [1])


@functools.lru_cache(maxsize=64)
def _head_index(dense_kv_heads: tuple, g: int, device: torch.device, inference: bool):
    """The dense heads' query heads (grouped by key/value head) as a tuple and as an index, and
    the key/value heads' index, made once per layout (no host-to-device copy per call)."""
    qh = tuple(j * g + i for j in dense_kv_heads for i in range(g))
    return (qh, torch.tensor(qh, dtype=torch.int64, device=device),
            torch.tensor(dense_kv_heads, dtype=torch.int64, device=device))


def _select(t: torch.Tensor, idx: torch.Tensor, heads: tuple) -> torch.Tensor:
    # A run of consecutive heads is a view; anything else a gather (small next to attention).
    contiguous = len(heads) == heads[-1] - heads[0] + 1
    return t.narrow(1, heads[0], len(heads)) if contiguous else t.index_select(1, idx)


def with_dense_heads(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     pattern: DilatedPattern, *, return_lse: bool = False, **kwargs):
    """``attend(q, k, v, pattern, return_lse=..., **kwargs)`` for a pattern with dense heads,
    from two calls of ``attend`` on patterns without them (module docstring): ``q [B, Hq, Sq,
    D]``, ``k/v [B, Hkv, Sk, D]``, ``out`` (and ``lse [B, Hq, Sq]``) with heads in dimension 1.
    """
    hq, hkv = q.shape[1], k.shape[1]
    pattern.check_kv_heads(hkv)
    # inference tensors cannot be saved for autograd: one cache entry per mode
    qh, qi, kvi = _head_index(pattern.dense_kv_heads, hq // hkv, q.device,
                              torch.is_inference_mode_enabled())
    dense = attend(_select(q, qi, qh), _select(k, kvi, pattern.dense_kv_heads),
                   _select(v, kvi, pattern.dense_kv_heads), DENSE, return_lse=return_lse, **kwargs)
    if len(pattern.dense_kv_heads) == hkv:
        return dense
    sparse = attend(q, k, v, pattern.sparse_part, return_lse=return_lse,
                    _skip_kv_heads=pattern.dense_kv_heads, **kwargs)
    return sparse.index_copy(1, qi, dense) if not return_lse else \
        (sparse[0].index_copy(1, qi, dense[0]), sparse[1].index_copy(1, qi, dense[1]))
