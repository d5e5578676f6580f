"""Dense key/value heads (``DilatedPattern.dense_kv_heads``) where a call splits them off.

The query heads ``h`` (reading key/value head ``h // (Hq // Hkv)``) of a dense key/value head
attend every key. The kernels run them as launches of the same call (``kernels.dilated_fwd``);
elsewhere (the PyTorch path, packed documents, the ring across ranks) a call with dense heads
is two calls that know nothing of them (the op's two prepared calls, the ring's two rings):

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


class DenseHeads:
    """The dense key/value heads of ``pattern`` (``Hq`` query and ``Hkv`` key/value heads, with
    heads in dimension 1): ``select`` gives their query heads' slice of q and theirs of k, v;
    ``merge`` puts a call's results on that slice into a call's on every head."""

    def __init__(self, pattern: DilatedPattern, hq: int, hkv: int):
        pattern.check_kv_heads(hkv)
        self.kv, self.group = pattern.dense_kv_heads, hq // hkv

    def _index(self, device):
        # inference tensors cannot be saved for autograd: one cache entry per mode
        return _head_index(self.kv, self.group, device, torch.is_inference_mode_enabled())

    def select(self, q, k, v) -> tuple:
        qh, qi, kvi = self._index(q.device)
        # a run of consecutive heads is a view; anything else a gather (small next to attention)
        return tuple(t.narrow(1, h[0], len(h)) if len(h) == h[-1] - h[0] + 1 else t.index_select(
            1, i) for t, h, i in ((q, qh, qi), (k, self.kv, kvi), (v, self.kv, kvi)))

    def merge(self, every: tuple, dense: tuple) -> tuple:
        """``(out, lse)`` of every head with the dense heads' from ``dense`` (an lse None in
        either: None)."""
        qi = self._index(dense[0].device)[1]
        return tuple(None if e is None or d is None else e.index_copy(1, qi, d)
                     for e, d in zip(every, dense))


def with_dense_heads(attend: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     pattern: DilatedPattern, *, return_lse: bool = False, **kwargs):
    """``attend(q, k, v, pattern, return_lse=..., **kwargs)`` for a pattern with dense heads,
    from two calls of ``attend`` on patterns without them (module docstring; the ring's, whose
    calls are collective): ``q [B, Hq, Sq, D]``, ``k/v [B, Hkv, Sk, D]``, ``out`` (and ``lse
    [B, Hq, Sq]``)."""
    heads = DenseHeads(pattern, q.shape[1], k.shape[1])
    dense = attend(*heads.select(q, k, v), DENSE, return_lse=return_lse, **kwargs)
    if len(pattern.dense_kv_heads) == k.shape[1]:
        return dense
    sparse = attend(q, k, v, pattern.sparse_part, return_lse=return_lse,
                    _skip_kv_heads=pattern.dense_kv_heads, **kwargs)
    return heads.merge(sparse, dense) if return_lse else heads.merge((sparse,), (dense,))[0]
