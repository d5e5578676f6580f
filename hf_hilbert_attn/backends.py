"""The backend seam: one forward/backward interface over the Triton kernels and the PyTorch
engines, and the one rule that picks between them (:func:`select_backend`), used by every entry
point of ``ops.py`` and by the ring:

* ``forward(q, k, v, pattern, a, causal, out=None, lse=None, plan=None) -> (out, lse)``
  (no autograd; into ``out`` / ``lse`` when given);
* ``backward(dout, dlse, q, k, v, out, lse, pattern, a, causal, grads=None, plan=None) ->
  (dq, dk, dv)``: the gradient of rows merged into ``(out, lse)`` (the ring: over disjoint keys);
* ``accumulate(..., acc, lse)`` and ``backward(..., dq_acc=, dkv_acc=)``: merge into / add into
  the given sums in place (the ring's pieces);
* ``position_plan(a, pattern)``: the plan to pass back as ``plan=`` (Triton: a ``PositionPlan``,
  ``False`` when the kernels cannot take these positions; None: nothing to keep).

``a``: ``inputs.check_inputs``'s result; no dense heads here (``dense_heads.py``). Triton runs
packed documents one call each and what the kernels cannot take on the PyTorch backend (warned
once per reason).
"""

from __future__ import annotations

import warnings

import torch

from .chunked import chunked_attention
from .engines.documents import document_runs as _document_ranges
from .inputs import KERNEL_DTYPES, KERNEL_HEAD_DIMS, check_inputs
from .numerics import accum_dtype, finite_or_zero, merge_into

__all__ = ["BACKENDS", "use_triton", "select_backend", "TorchBackend", "TritonBackend",
           "document_runs", "reset_fallback_warnings"]

BACKENDS = ("auto", "torch", "triton")


def use_triton(q: torch.Tensor, a, backend: str) -> bool:
    """Whether a call goes to the Triton kernels (the one dispatch rule of every entry point).

    ``backend="triton"``: yes on CUDA, or on any device under ``TRITON_INTERPRET=1`` (Triton's
    interpreter, how the tests run them on CPU); a ``ValueError`` elsewhere or when the kernels
    cannot take the dtype or head size; ``"auto"``: yes on CUDA when they can; ``"torch"``: no.
    Static checks only (traceable); data-dependent limits are checked inside the op, which then
    runs the PyTorch path; an empty batch takes it too."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not q.is_cuda):
        return False
    if backend == "triton" and not q.is_cuda:  # Triton's interpreter takes any device
        import os  # read per call, as kernels/_config.py's KernelConfig.from_env does

        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"backend='triton' needs CUDA tensors (got {q.device.type}) or "
                f"TRITON_INTERPRET=1 in the environment before hf_hilbert_attn is imported "
                f"(Triton's interpreter: slow, for tests); on {q.device.type} use "
                f"backend='auto' or 'torch' (the PyTorch path)")
    ok = (q.dtype in KERNEL_DTYPES and a.head_dim in KERNEL_HEAD_DIMS
          and a.head_dim_v == a.head_dim and _triton_importable())
    if backend == "triton" and not ok:
        raise ValueError(
            f"backend='triton' needs float16/bfloat16/float32 and head_dim in "
            f"{KERNEL_HEAD_DIMS} (same for v), got {q.dtype}, head_dim {a.head_dim}/"
            f"{a.head_dim_v}; use backend='auto' or 'torch'")
    return ok and a.batch > 0


def _triton_importable() -> bool:
    try:  # an import statement (dynamo traces it), not find_spec: a broken install takes PyTorch
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
        return False
    return True


def _kernels():
    from . import kernels  # imports Triton: only once a call goes to the kernels

    return kernels


def select_backend(q: torch.Tensor, a, backend: str):
    """The backend of a call (:func:`use_triton`)."""
    return TRITON if use_triton(q, a, backend) else TORCH


def _into(results, targets):
    """``results``, copied into ``targets`` where one is given."""
    return tuple(r if t is None else t.copy_(r) for r, t in zip(results, targets))


def _add_grads(grads, dq_acc, dkv_acc):
    """``grads`` with dq added into ``dq_acc`` and dk, dv into ``dkv_acc`` where given (those
    returned in their place)."""
    sums = (dq_acc,) + tuple(dkv_acc or (None, None))
    return tuple(g if t is None else t.add_(g.to(t.dtype)) for g, t in zip(grads, sums))


class TorchBackend:
    """The PyTorch engines (``chunked.py`` picks one per call). A piece merged or added into
    given sums (``accumulate``; ``backward``'s ``dq_acc`` / ``dkv_acc``) is computed in the
    sums' dtype (float32 for float16/bfloat16 inputs) and never rounded to the inputs' dtype
    on the way in, as the kernels keep their float32 sums: the ring's pieces round once, at its
    end."""

    name = "torch"

    @staticmethod
    def _widened(dtype, *ts):
        """``ts`` in ``dtype`` where it is wider than theirs (float16/bfloat16 in float32:
        exact), else as they are: a piece merged or added into float32 sums keeps its result in
        float32 (the engines compute in it anyway) instead of rounding it to the inputs' dtype."""
        return tuple(t.to(dtype) if torch.finfo(dtype).bits > torch.finfo(t.dtype).bits else t
                     for t in ts)

    def accumulate(self, q, k, v, pattern, a, causal, acc, lse, plan=None):
        q, k, v = self._widened(acc.dtype, q, k, v)
        return merge_into(acc, lse, *self.forward(q, k, v, pattern, a, causal))

    def position_plan(self, a, pattern):
        return None

    def forward(self, q, k, v, pattern, a, causal, out=None, lse=None, plan=None):
        with torch.no_grad():
            return _into(chunked_attention(q, k, v, pattern, a, causal=causal), (out, lse))

    def backward(self, dout, dlse, q, k, v, out, lse, pattern, a, causal, grads=None,
                 plan=None, dq_acc=None, dkv_acc=None):
        dtypes = (q.dtype, k.dtype, v.dtype)
        sums = (dq_acc,) + tuple(dkv_acc or (None, None))
        for acc in (s for s in sums if s is not None):  # the piece's gradients in the sums' dtype
            q, k, v = self._widened(acc.dtype, q, k, v)  # (widest); one in ``grads`` rounds once
        g = _recompute_backward(dout, dlse, q, k, v, out, lse, pattern, a, causal)
        given = (None,) * 3 if grads is None else grads
        g = _add_grads(_into(g, given), dq_acc, dkv_acc)
        # a gradient returned in no given tensor: in its input's dtype, as without sums
        return tuple(x if t is not None or s is not None else x.to(dt)
                     for x, t, s, dt in zip(g, given, sums, dtypes))


class TritonBackend:
    """The Triton kernels; one call per document for packed documents; the PyTorch backend for
    positions the kernels cannot take (with a warning, once per reason)."""

    name = "triton"

    def position_plan(self, a, pattern):
        return self._plan(a, pattern, None)[0] or False

    def _plan(self, a, pattern, plan):
        return (plan, None) if plan else _kernels().plan_positions(a, pattern)

    def accumulate(self, q, k, v, pattern, a, causal, acc, lse, plan=None):
        plan, _ = self._plan(a, pattern, plan)
        if plan is not None and acc.dtype == lse.dtype == torch.float32:  # in the kernels
            return _kernels().dilated_fwd(q, k, v, pattern, a.scale, causal, plan, lse=lse,
                                          acc=acc, **_kernel_kw(a))
        return merge_into(acc, lse, *self.forward(q, k, v, pattern, a, causal, plan=plan))

    def forward(self, q, k, v, pattern, a, causal, out=None, lse=None, plan=None):
        dilated_fwd = _kernels().dilated_fwd
        plan, why = self._plan(a, pattern, plan)
        if plan is not None:
            return dilated_fwd(q, k, v, pattern, a.scale, causal, plan, out=out, lse=lse,
                               **_kernel_kw(a))
        runs = document_runs(q, k, v, pattern, a)
        if runs is not None:  # packed documents: one kernel call per document, in place
            out = torch.zeros_like(q) if out is None else out.zero_()
            lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32) if lse is None \
                else lse.fill_(float("-inf"))
            for b, lo, hi, sub_plan in runs:
                sl = (slice(b, b + 1), slice(None), slice(lo, hi))
                dilated_fwd(q[sl], k[sl], v[sl], pattern, a.scale, causal, sub_plan, out=out[sl],
                            lse=lse[sl], **_kernel_kw(a))
            return out, lse
        _warn_fallback(why)
        o, l = TORCH.forward(q, k, v, pattern, a, causal)
        return _into((o.contiguous(), l.float().contiguous()), (out, lse))

    def backward(self, dout, dlse, q, k, v, out, lse, pattern, a, causal, grads=None,
                 plan=None, dq_acc=None, dkv_acc=None):
        dilated_bwd = _kernels().dilated_bwd
        grads = (None, None, None) if grads is None else grads
        plan, _ = self._plan(a, pattern, plan)
        if plan is not None:  # float32 sums in the kernels, others added here
            q32 = dq_acc if dq_acc is not None and dq_acc.dtype == torch.float32 else None
            kv32 = dkv_acc if dkv_acc is not None and dkv_acc[0].dtype == torch.float32 else None
            return _add_grads(dilated_bwd(dout, q, k, v, out, lse, dlse, pattern, a.scale, causal,
                                          plan, *grads, **_kernel_kw(a), dq_acc=q32, dkv_acc=kv32),
                              dq_acc if q32 is None else None, dkv_acc if kv32 is None else None)
        runs = document_runs(q, k, v, pattern, a)
        if runs is not None:  # packed documents, as in the forward
            dq, dk, dv = (torch.zeros_like(t) if g is None else g.zero_()
                          for g, t in zip(grads, (q, k, v)))
            for b, lo, hi, sub_plan in runs:
                sl = (slice(b, b + 1), slice(None), slice(lo, hi))
                dilated_bwd(dout[sl], q[sl], k[sl], v[sl], out[sl], lse[sl],
                            None if dlse is None else dlse[sl], pattern, a.scale, causal,
                            sub_plan, dq[sl], dk[sl], dv[sl], **_kernel_kw(a))
            return _add_grads((dq, dk, dv), dq_acc, dkv_acc)
        # anything else: differentiate the PyTorch path (the forward's fallback)
        return TORCH.backward(dout, dlse, q, k, v, out, lse, pattern, a, causal, grads,
                              dq_acc=dq_acc, dkv_acc=dkv_acc)


TORCH, TRITON = TorchBackend(), TritonBackend()


def _kernel_kw(a) -> dict:
    """What a kernels' call takes from the checked inputs ``a`` besides scale and positions."""
    return dict(skip=a.skip_kv_heads, head_base=a.head_base, softcap=a.softcap)


def document_runs(q, k, v, pattern, a):
    """Packed self-attention as per-document kernel calls (``a``: ``check_inputs``).

    Returns ``[(batch_row, lo, hi, plan)]`` — the documents of ``engines.documents
    .document_runs`` and the kernels' plan of each — or None when the layout is anything else
    or the kernels cannot plan a document (then the PyTorch path runs).
    """
    ranges, runs = _document_ranges(a), []
    for b, lo, hi, p0 in ranges or ():
        positions = None if p0 == 0 else a.q_positions.expand(a.batch, a.sq)[b, lo:hi]
        sub = check_inputs(*(t[b:b + 1, :, lo:hi] for t in (q, k, v)), pattern, scale=a.scale,
                           q_positions=positions, k_positions=positions, softcap=a.softcap or None)
        plan, _ = _kernels().plan_positions(sub, pattern)
        if plan is None:
            return None
        runs.append((b, lo, hi, plan))
    return None if ranges is None else runs


_WARNED = set()


def reset_fallback_warnings() -> None:
    """Forget which fallback reasons were reported, so each warns again (tests)."""
    _WARNED.clear()


def _warn_fallback(why: str) -> None:
    """Say once per reason that a call meant for the kernels runs on the PyTorch path (correct,
    but much slower on a GPU) instead of staying silent."""
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"hf_hilbert_attn: the Triton kernels cannot take these positions ({why}); "
                      "this call runs on the PyTorch path (correct, much slower on a GPU). See "
                      "docs/kernels.md, 'Fallbacks'.", RuntimeWarning, stacklevel=4)


def _recompute_backward(dout, dlse, q, k, v, out, lse, pattern, a, causal):
    """(dq, dk, dv) on the PyTorch path, for a call whose rows were merged into ``(out, lse)``
    (its own result, or the ring's merge over disjoint keys): the call is recomputed as
    ``(o_b, lse_b)`` and differentiated with ``grad(o_b) = c·dout`` and ``grad(lse_b) =
    c·(dout·o_b - dout·out + dlse)``, ``c = exp(lse_b - lse)`` its share of the merge: the
    Triton backward's ``dS = P ∘ (dP - delta)`` with the merged probabilities.
    """
    acc = accum_dtype(q.dtype)
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o_b, l_b = chunked_attention(qq, kk, vv, pattern, a, causal=causal)
        c = torch.exp(l_b.detach().to(acc) - finite_or_zero(lse.to(acc)))  # 0: no key here
        do = dout.to(acc)
        delta = (do * out.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        g_o = (do * c.unsqueeze(-1)).to(o_b.dtype)
        g_l = c * ((do * o_b.detach().to(acc)).sum(-1) - delta)
        dq, dk, dv = torch.autograd.grad((o_b, l_b), (qq, kk, vv), (g_o, g_l.to(l_b.dtype)),
                                         allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous()
                 for g, t in ((dq, q), (dk, k), (dv, v)))
