"""The public op ``dilated_attention`` and its dispatch between the PyTorch and Triton paths."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .backends import TRITON, _kernels, use_triton
from .chunked import chunked_attention
from .dense_heads import DENSE, DenseHeads
from .hilbert import hilbert_permutation, storage_ordering
from .inputs import check_inputs
from .numerics import autocast_inputs, autocast_off
from .pattern import ORDERINGS, DilatedPattern
# a call may skip the custom ops when eager, under no torch.func transform (the condition under
# which plans are memoised): torch.compile and transforms need the ops and their formulas
from .plan_cache import caching_enabled as _eager, memoised


def dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: DilatedPattern,
                      *, causal: bool = True, scale: Optional[float] = None,
                      q_positions: Optional[torch.Tensor] = None,
                      k_positions: Optional[torch.Tensor] = None,
                      q_doc_ids: Optional[torch.Tensor] = None,
                      k_doc_ids: Optional[torch.Tensor] = None, return_lse: bool = False,
                      backend: str = "auto", ordering: Optional[str] = None,
                      softcap: Optional[float] = None, _skip_kv_heads: tuple = (),
                      _head_base: int = 0):
    """LongNet-style dilated attention (the rule: README "The pattern", ``pattern.py``),
    differentiable.

    Args:
        q: ``[B, Hq, Sq, D]``.
        k, v: ``[B, Hkv, Sk, D]`` with ``Hq % Hkv == 0``; query head ``h`` reads key/value head
            ``h // (Hq // Hkv)`` (never expanded in memory on the fast paths).
        pattern: the :class:`DilatedPattern`.
        causal: keys at positions ``> p`` are masked for a query at ``p``.
        scale: softmax scale, default ``D ** -0.5``.
        q_positions, k_positions: true positions ``[S]`` or ``[B, S]`` of the stored tokens
            (any storage order, e.g. Hilbert order or a ring shard). Default: keys at
            ``0..Sk-1``, queries at the last ``Sq`` positions (bottom-right aligned: 5, 6, 7
            for ``Sq = 3, Sk = 8``).
        q_doc_ids, k_doc_ids: document ids ``[S]`` or ``[B, S]`` for packed sequences; a pair is
            allowed only within a document; a negative key id marks padding.
        return_lse: also return the log-sum-exp ``[B, Hq, Sq]`` in float32 (natural log; ``-inf``
            for a query with no allowed key, whose output is 0).
        backend: ``"auto"`` (Triton on CUDA when the shape is supported, else PyTorch),
            ``"torch"`` or ``"triton"``.
        ordering: the layout computed in, ``"natural"``, ``"hilbert"`` or ``"auto"`` (default
            ``pattern.ordering``): ``"hilbert"`` permutes self-attention at ``0..S-1`` into the
            pattern's Hilbert order and back, the same function (explicit positions: already in
            the caller's storage order).
        softcap: take every score ``s`` (scaled) as ``softcap * tanh(s / softcap)`` before
            the softmax (Gemma 2's attention logit soft-capping); None: not.

    Returns:
        ``out`` ``[B, Hq, Sq, D]`` in the input dtype, and ``lse`` if ``return_lse``.
    """
    if ordering is not None and ordering not in ORDERINGS:
        raise ValueError(f"ordering must be one of {ORDERINGS}, got {ordering!r}")
    q, k, v = autocast_inputs(q, k, v)  # under torch.autocast: cast as SDPA does, then off
    key = _prepared_key(q, k, v, pattern, (q_positions, k_positions, q_doc_ids, k_doc_ids),
                        ordering, _skip_kv_heads, causal, scale, return_lse, backend, softcap,
                        _head_base)
    with autocast_off(q):
        call = None if key is None else _PREPARED.get(key)  # checked and routed by a call like it
        if call is None:
            a = check_inputs(q, k, v, pattern, scale=scale, q_positions=q_positions,
                             k_positions=k_positions, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                             softcap=softcap)
            if _skip_kv_heads or _head_base:  # (private) heads whose results the caller
                # discards (dense_heads.py); the number of head 0 in the rule (ring/ulysses.py)
                a = dataclasses.replace(a, skip_kv_heads=tuple(_skip_kv_heads),
                                        head_base=_head_base)
            call = _route(q, pattern, a, causal, return_lse, backend, ordering)
            if key is not None:
                memoised(_PREPARED, key, 256, lambda: call)
        out, lse = call.run(q, k, v)
    return (out, lse.float()) if return_lse else out  # (lse: float32 for every input dtype)


def _route(q, pattern: DilatedPattern, a, causal: bool, return_lse: bool, backend: str,
           ordering: Optional[str]) -> "_Call":
    """The prepared call of checked inputs ``a`` (``q``: their dtype and device), in this order:
    SDPA where the pattern allows every pair; dense key/value heads split off where the kernels
    do not run them; the Hilbert layout where asked; the kernels or the PyTorch path."""
    triton = use_triton(q, a, backend)
    if _dense_call(pattern, a, causal, return_lse, backend):
        return _Sdpa(pattern, a, causal, q)
    if pattern.dense_kv_heads and not _dense_heads_in_kernels(triton, a, pattern):
        return _Split(pattern, a, causal, q, return_lse, backend, ordering)
    if a.natural_positions and a.sq == a.sk > 1 and \
            storage_ordering(pattern, a.sq, a.head_dim, q.device, ordering) == "hilbert":
        return _Permuted(pattern, a, causal, q, return_lse, backend)
    if not triton:
        return _Chunked(pattern, a, causal, q)
    if _eager():
        return _Kernels(pattern, a, causal, q)
    if a.head_base:
        raise NotImplementedError("head-sharded attention runs eagerly (outside torch.compile "
                                  "and torch.func transforms)")
    return _Ops(pattern, a, causal, q)


# Prepared calls of eager calls at positions 0..S-1, by what the checks and the route depend
# on. Every layer of a model's forward calls alike, so its first call checks, routes and plans,
# and the others run the prepared call.
_PREPARED: dict = {}


def _prepared_key(q, k, v, pattern, given: tuple, *args) -> Optional[tuple]:
    """What the checks and the route of an eager call at the default positions depend on (on a
    CPU, also whether Triton's interpreter is asked for: ``use_triton`` reads it per call; the
    pattern's layout, which its equality leaves out); None for other calls (``given``: their
    positions and document ids) and for arguments the checks will refuse."""
    if any(g is not None for g in given) or not isinstance(pattern, DilatedPattern) or not all(
            isinstance(t, torch.Tensor) for t in (q, k, v)) or not _eager():
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            pattern, pattern.ordering, *args, q.is_cuda or os.environ.get("TRITON_INTERPRET"))


def prepared(q, k, v, pattern, *, causal: bool = True, scale: Optional[float] = None,
             softcap: Optional[float] = None):
    """The prepared call of ``dilated_attention(q, k, v, pattern, causal=causal, scale=scale,
    softcap=softcap)`` once one like it ran on the kernels or SDPA (eager, positions ``0..S-1``),
    or None. A caller that repeats that call (a model's layers) runs ``prepared(q, k, v)`` (the
    output) on inputs that ``fits`` it (cast as the op casts): no checks or routing per call."""
    call = _PREPARED.get(_prepared_key(  # (the key of dilated_attention's call, as it makes it)
        q, k, v, pattern, (None,) * 4, None, (), causal, scale, False, "auto", softcap, 0))
    return call if isinstance(call, (_Kernels, _Sdpa)) else None  # (others cast inside)


class _Call:
    """A checked and routed call of the op: ``run(q, k, v)`` computes ``(out, lse)`` (lse None
    where the route computes none: SDPA) on inputs like those it was made for (``fits``);
    ``call``: ``(pattern, a, causal)``, ``a`` the checked inputs."""

    def __init__(self, pattern, a, causal, q):
        self.call = (pattern, a, bool(causal))
        kv = (a.batch, a.hkv, a.sk)
        self.inputs = ((a.batch, a.hq, a.sq, a.head_dim), (*kv, a.head_dim), (*kv, a.head_dim_v),
                       q.dtype, q.dtype, q.dtype, q.device)

    def fits(self, q, k, v, scale=None, softcap=None) -> bool:
        """Whether ``q``, ``k``, ``v`` are inputs like this call's (shapes, dtypes, device) and
        ``scale``, ``softcap`` its own, the call eager. Under autocast the caller passes them
        as the op would compute with them (``numerics.autocast_inputs``)."""
        a = self.call[1]
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device) == self.inputs \
            and (q.shape[-1] ** -0.5 if scale is None else scale) == a.scale \
            and (softcap or 0.0) == a.softcap and _eager()

    def __call__(self, q, k, v):
        return self.run(q, k, v)[0]


class _Sdpa(_Call):
    """The pattern allows every pair here: the fastest dense path is SDPA (FlashAttention /
    cuDNN on CUDA, its fused CPU kernel elsewhere)."""

    def run(self, q, k, v):
        a, causal = self.call[1:]
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and a.sq > 1,
                                              scale=a.scale, enable_gqa=a.hq != a.hkv), None


class _Chunked(_Call):
    """The PyTorch path (``chunked.py``)."""

    def run(self, q, k, v):
        pattern, a, causal = self.call
        return chunked_attention(q, k, v, pattern, a, causal=causal)


class _Split(_Call):
    """Dense key/value heads where the kernels do not run them (``dense_heads.py``): their
    query heads' slice as plain attention, every head with the sparse part (the dense heads'
    share discarded), merged; each a prepared call of its own."""

    def __init__(self, pattern, a, causal, q, *route):
        super().__init__(pattern, a, causal, q)
        self.heads, n = DenseHeads(pattern, a.hq, a.hkv), len(pattern.dense_kv_heads)
        self.dense = _route(q, DENSE, dataclasses.replace(a, hq=n * (a.hq // a.hkv), hkv=n),
                            causal, *route)
        self.sparse = None if n == a.hkv else _route(q, pattern.sparse_part, dataclasses.replace(
            a, skip_kv_heads=pattern.dense_kv_heads), causal, *route)

    def run(self, q, k, v):
        dense = self.dense.run(*self.heads.select(q, k, v))
        return dense if self.sparse is None else self.heads.merge(self.sparse.run(q, k, v), dense)


class _Permuted(_Call):
    """Self-attention at ``0..S-1`` computed in the pattern's Hilbert layout: q, k, v (and the
    document ids) permuted into storage order, attended at their true positions, ``out`` and
    ``lse`` restored to natural order (``docs/hilbert.md``)."""

    def __init__(self, pattern, a, causal, q, *route):
        super().__init__(pattern, a, causal, q)
        self.perm, self.inv = hilbert_permutation(a.sq, pattern, q.device)  # perm[i]: position
        docs = [None if d is None else d.index_select(-1, self.perm)  # stored at i
                for d in (a.q_doc_ids, a.k_doc_ids)]
        at = dataclasses.replace(a, q_positions=self.perm[None], k_positions=self.perm[None],
                                 q_doc_ids=docs[0], k_doc_ids=docs[1], natural_positions=False)
        self.inner = _route(q, pattern, at, causal, *route, None)

    def run(self, q, k, v):
        out, lse = self.inner.run(*(t.index_select(2, self.perm) for t in (q, k, v)))
        return out.index_select(2, self.inv), None if lse is None else lse.index_select(2, self.inv)


class _Ops(_Call):
    """The custom ops, where ``torch.compile`` or a ``torch.func`` transform needs them: explicit
    positions travel to the op, which builds the position -> storage map (or falls back to the
    PyTorch path when the kernels cannot take them)."""

    def run(self, q, k, v):
        pattern, a, causal = self.call
        pos = (None, None) if a.natural_positions else (a.q_positions, a.k_positions)
        return torch.ops.hf_hilbert_attn.dilated_attention_fwd(  # the pattern as the schema's
            q, k, v, *pos, a.q_doc_ids, a.k_doc_ids, list(pattern.segment_lengths),  # types
            list(pattern.dilation_rates), pattern.query_dilation, int(pattern.sink_tokens),
            pattern.window, list(pattern.dense_kv_heads), bool(causal), float(a.scale),
            a.softcap)


class _Kernels(_Call):
    """An eager call of the kernels, its positions planned once: its forward and backward run
    the kernels' runners (``kernels.fwd_runner``, made at its first forward; ``bwd_runner`` at
    its first backward), or the backend's routes where the kernels cannot take the positions
    (packed documents, the PyTorch fallback)."""

    def __init__(self, pattern, a, causal, q):
        super().__init__(pattern, a, causal, q)
        self.plan = TRITON.position_plan(a, pattern) if a.sq and a.sk else False
        self.fwd = self.bwd = None

    def run(self, q, k, v):
        """``(out, lse)``: through the kernels' autograd Function where a gradient is recorded,
        else the forward alone (inference: evaluation, a prefill)."""
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _EagerKernels.apply(q, k, v, self)
        return self.forward(q, k, v)

    def _runner(self, run, which, q, k):
        """``run`` while the kernels' configuration it was made under is in force, else a new
        runner (``kernels.configure`` changes tiles and buffers for calls made after it)."""
        if run is not None and not run.stale():
            return run
        pattern, a, causal = self.call
        return getattr(_kernels(), which)(q, k, pattern, self.plan, causal, a.scale,
                                          a.skip_kv_heads, head_base=a.head_base,
                                          softcap=a.softcap)

    def forward(self, q, k, v):
        if not self.plan:
            return TRITON.forward(q, k, v, *self.call)
        self.fwd = self._runner(self.fwd, "fwd_runner", q, k)
        return self.fwd(q, k, v)

    def backward(self, dout, dlse, q, k, v, out, lse):
        if not self.plan:
            return TRITON.backward(dout, dlse, q, k, v, out, lse, *self.call)
        self.bwd = self._runner(self.bwd, "bwd_runner", q, k)
        return self.bwd(dout, q, k, v, out, lse, dlse)


# Query rows (B * Sq) up to which the kernels run dense heads at positions 0..S-1 themselves;
# longer, SDPA's dense kernels are faster on them than ours (docs/decisions.md D50).
DENSE_HEADS_IN_KERNELS_ROWS = 8192


def _dense_heads_in_kernels(triton: bool, a, pattern: DilatedPattern) -> bool:
    """Whether the kernels run this call's dense key/value heads themselves (one more launch
    per kernel, ``kernels.dilated_fwd``): on the kernels' path where they plan the positions
    (eager; compiled: positions ``0..S-1``), no documents; at positions ``0..S-1`` for up to
    ``DENSE_HEADS_IN_KERNELS_ROWS`` query rows (else SDPA takes them, with_dense_heads)."""
    return triton and a.q_doc_ids is None and (
        a.batch * a.sq <= DENSE_HEADS_IN_KERNELS_ROWS if a.natural_positions
        else _eager() and TRITON.position_plan(a, pattern) is not False)


def _dense_call(pattern: DilatedPattern, a, causal: bool, return_lse: bool, backend: str) -> bool:
    """Whether SDPA computes this call exactly: positions ``0..Sk-1`` (queries the last ``Sq``,
    causal only as a square or a single query, SDPA's causal mask being top-left aligned), no
    documents or padding, no lse asked, no soft-capping, and a pattern that allows every pair
    of ``Sk`` tokens;
    ``backend="auto"`` only (the others name an engine). Host-side facts only (no device sync)."""
    return (backend == "auto" and not return_lse and a.natural_positions and a.q_doc_ids is None
            and not a.softcap and a.batch > 0 and a.sk > 0
            and (not causal or a.sq == a.sk or a.sq == 1)
            and a.head_dim == a.head_dim_v and pattern.is_dense_for(a.sk))


# ---------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile (no graph break), with fake implementations
# for tracing and an autograd formula that calls the backward op.


# The pattern of a custom-op call, validated once per argument tuple.
_op_pattern = functools.lru_cache(maxsize=64)(DilatedPattern)


def _op_inputs(q, k, v, qp, kp, qd, kd, segment_lengths, dilation_rates, query_dilation,
               sink_tokens, window, dense_kv_heads, scale, softcap):
    pattern = _op_pattern(tuple(segment_lengths), tuple(dilation_rates), query_dilation,
                          sink_tokens=int(sink_tokens), window=window,
                          dense_kv_heads=tuple(dense_kv_heads))
    return pattern, check_inputs(q, k, v, pattern, scale=scale, q_positions=qp, k_positions=kp,
                                 q_doc_ids=qd, k_doc_ids=kd, softcap=softcap or None)


@torch.library.custom_op("hf_hilbert_attn::dilated_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
    q_doc_ids: Optional[torch.Tensor], k_doc_ids: Optional[torch.Tensor],
    segment_lengths: List[int], dilation_rates: List[int], query_dilation: str,
    sink_tokens: int, window: str, dense_kv_heads: List[int], causal: bool, scale: float,
    softcap: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return TRITON.forward(q, k, v, *_op_inputs(  # (pattern, checked inputs)
        q, k, v, q_positions, k_positions, q_doc_ids, k_doc_ids, segment_lengths, dilation_rates,
        query_dilation, sink_tokens, window, dense_kv_heads, scale, softcap), causal)


@_fwd_op.register_fake
def _(q, k, v, *args):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("hf_hilbert_attn::dilated_attention_bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor, dlse: Optional[torch.Tensor],
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    q_positions: Optional[torch.Tensor], k_positions: Optional[torch.Tensor],
    q_doc_ids: Optional[torch.Tensor], k_doc_ids: Optional[torch.Tensor],
    segment_lengths: List[int], dilation_rates: List[int], query_dilation: str,
    sink_tokens: int, window: str, dense_kv_heads: List[int], causal: bool, scale: float,
    softcap: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return TRITON.backward(dout, dlse, q, k, v, out, lse, *_op_inputs(  # (pattern, checked inputs)
        q, k, v, q_positions, k_positions, q_doc_ids, k_doc_ids, segment_lengths, dilation_rates,
        query_dilation, sink_tokens, window, dense_kv_heads, scale, softcap), causal)


@_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output, *inputs[3:7])  # q, k, v, out, lse, positions, docs
    ctx.static = inputs[7:]
    # an unused lse (the usual case) arrives as None, not as a zero tensor to fill and read
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, *rest = ctx.saved_tensors  # lse, then the optionals (they come back as None)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv = torch.ops.hf_hilbert_attn.dilated_attention_bwd(
            torch.zeros_like(out) if dout is None else dout, dlse, q, k, v, out, *rest, *ctx.static)
    return (dq, dk, dv) + (None,) * 13


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerKernels(torch.autograd.Function):
    """The custom ops' work for eager calls, without the dispatcher, on a prepared call
    (:class:`_Kernels`: the op's re-check, autograd wrapper and per-call planning lookups cost
    most of the host time of a short call: ``examples/benchmarks/host_overhead.py``), or on a
    ring's call (``ring.attention._Ctx``): ``prep.forward``, then ``prep.backward``."""

    @staticmethod
    def forward(ctx, q, k, v, prep):
        out, lse = prep.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prep = prep
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # (no autocast context: the kernels' host code casts nothing)
        return (*ctx.prep.backward(torch.zeros_like(out) if dout is None else dout, dlse,
                                   q, k, v, out, lse), None)
