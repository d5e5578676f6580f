"""Baselines the attention benchmark compares our kernels with, on the same dilated pattern.

* :func:`gather_sdpa_attention` — the LongNet / torchscale approach: for every config, gather each
  segment's dilation class into a dense sub-sequence, run causal SDPA on it (a fused kernel that
  also returns the log-sum-exp), scatter back and LSE-merge the configs. A key allowed by several
  configs is counted once per config (the diagonal always is, in every config that sees the
  query), so this is **not** the function of the pattern (README, "The pattern"); every output labels it
  ``"gather-sdpa (double-counts overlaps)"``. :func:`double_counted_reference` is the dense
  definition of what it computes (each key's softmax weight times the number of configs that
  allow it), used by the tests.
* :class:`FlexDilated` — FlexAttention with the pattern's ``mask_mod`` (block mask built once,
  ``flex_attention`` compiled), timing its build and compile apart from its run.

Neither is library code: they live beside the benchmark that needs them.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

import torch

from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.pattern import DilatedPattern

__all__ = [
    "GATHER_LABEL",
    "GatherPlan",
    "build_gather_plan",
    "gather_sdpa_attention",
    "gather_pairs",
    "gather_kernel_names",
    "double_counted_reference",
    "FlexDilated",
]

GATHER_LABEL = "gather-sdpa (double-counts overlaps)"


# ============================================================================ the gather plan
@dataclass
class _ConfigPlan:
    """Where one config's dense sub-sequences come from.

    The gathered layout of q is ``[B * nseg, Uq, L, D]``: batch × segment, then one *unit* per
    (query head, dilation class) that the config uses, then the class's ``L = ceil(w' / r)``
    tokens in position order (``w' = min(w, S)`` rounded up to a multiple of ``r``). K/V use
    ``Uk`` units of (key/value head, class); ``Uq == group * Uk`` and q unit ``u`` reads K unit
    ``u // group`` (SDPA's GQA convention), so K/V are gathered once per class they serve, not
    once per query head, whenever the head → class map allows it.
    """

    w: int
    r: int
    seg: int  # effective segment length in the gathered layout (w, or less if S < w)
    nseg: int
    L: int
    uq: int
    uk: int
    group: int
    q_src: torch.Tensor  # [Nq] int64 flat index head * S + pos into x.view(B, H * S, ...)
    q_slot: Optional[torch.Tensor]  # [Nq] flat index into [nseg * Uq * L]; None: identity
    k_src: torch.Tensor
    k_slot: Optional[torch.Tensor]

    @property
    def padded(self) -> bool:
        return self.q_slot is not None or self.k_slot is not None


@dataclass
class GatherPlan:
    """Index tables of every config for one (pattern, S, Hq, Hkv, device); see :func:`build_gather_plan`."""

    seq_len: int
    hq: int
    hkv: int
    configs: List[_ConfigPlan]

    @property
    def padded(self) -> bool:
        return any(c.padded for c in self.configs)


def _unit_indices(heads, classes, w, r, seg, nseg, L, S, H, device):
    """Flat source indices and gathered slots of ``U`` units ``(heads[u], classes[u])``.

    Slot ``(n, u, j)`` holds position ``n*w + classes[u] + j*r`` of head ``heads[u]``; it is
    padding (left zero) when that offset is past the segment (``>= seg``) or the sequence (``>= S``).
    """
    U = len(heads)
    h = torch.tensor(heads, dtype=torch.int64, device=device).view(1, U, 1)
    c = torch.tensor(classes, dtype=torch.int64, device=device).view(1, U, 1)
    n = torch.arange(nseg, dtype=torch.int64, device=device).view(nseg, 1, 1)
    j = torch.arange(L, dtype=torch.int64, device=device).view(1, 1, L)
    t = c + j * r  # offset inside the segment, [1, U, L]
    pos = n * w + t  # [nseg, U, L]
    valid = (t < seg) & (pos < S)
    src = (h * S + pos).expand(nseg, U, L)
    if bool(valid.all()):
        return src.reshape(-1).contiguous(), None
    slot = torch.arange(nseg * U * L, device=device).view(nseg, U, L)
    return src[valid].contiguous(), slot[valid].contiguous()


def build_gather_plan(pattern: DilatedPattern, seq_len: int, num_heads: int, num_kv_heads: int,
                      device=None) -> GatherPlan:
    """Index tables for :func:`gather_sdpa_attention` (cached; build it before timing).

    Args:
        pattern: the dilated pattern; both ``query_dilation`` modes are supported.
        seq_len: ``S`` (natural positions ``0..S-1``, self-attention).
        num_heads, num_kv_heads: ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``).
        device: where the index tensors live.

    Returns:
        A :class:`GatherPlan`.

    Raises:
        ValueError: if ``Hq`` is not a multiple of ``Hkv`` or ``seq_len < 1``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return _build_plan_cached(pattern, int(seq_len), int(num_heads), int(num_kv_heads),
                              torch.device(device) if device is not None else torch.device("cpu"))


@lru_cache(maxsize=4)  # index tables are O(Hq * S) each; keep few alive
def _build_plan_cached(pattern, S, hq, hkv, device):
    g = hq // hkv
    plans = []
    for w, r in pattern.configs:
        seg = min(w, S)
        L = -(-seg // r)  # ceil: class c holds offsets c, c+r, ... < seg
        nseg = -(-S // w)
        if pattern.query_dilation == "per_head":
            q_units = [(h, h % r) for h in range(hq)]
        else:  # "all": every query head uses every class
            q_units = [(h, c) for h in range(hq) for c in range(r)]
        # Units sharing a K unit (kv head, class) must be adjacent and equally many for SDPA's GQA.
        q_units.sort(key=lambda u: (u[0] // g, u[1], u[0]))
        k_of = [(h // g, c) for h, c in q_units]
        k_units = list(dict.fromkeys(k_of))
        counts = {ku: k_of.count(ku) for ku in k_units}
        group = next(iter(counts.values()))
        if any(cnt != group for cnt in counts.values()):
            k_units, group = k_of, 1  # uneven: one K unit per query unit (K gathered per q head)
        q_src, q_slot = _unit_indices([u[0] for u in q_units], [u[1] for u in q_units],
                                      w, r, seg, nseg, L, S, hq, device)
        k_src, k_slot = _unit_indices([u[0] for u in k_units], [u[1] for u in k_units],
                                      w, r, seg, nseg, L, S, hkv, device)
        plans.append(_ConfigPlan(w, r, seg, nseg, L, len(q_units), len(k_units), group,
                                 q_src, q_slot, k_src, k_slot))
    return GatherPlan(S, hq, hkv, plans)


def _gather(x: torch.Tensor, src, slot, nseg: int, U: int, L: int) -> torch.Tensor:
    """``x`` ``[B, H, S, *rest]`` → ``[B * nseg, U, L, *rest]`` (padding slots zero)."""
    B, H, S = x.shape[:3]
    rest = x.shape[3:]
    vals = x.reshape(B, H * S, *rest).index_select(1, src)
    if slot is not None:
        full = x.new_zeros(B, nseg * U * L, *rest)
        full.index_copy_(1, slot, vals)
        vals = full
    return vals.view(B * nseg, U, L, *rest)


def _ungather(g: torch.Tensor, slot, B: int) -> torch.Tensor:
    """Gathered ``[B * nseg, U, L, *rest]`` → the valid slots ``[B, N, *rest]`` (order of ``src``)."""
    rest = g.shape[3:]
    flat = g.reshape(B, -1, *rest)
    return flat if slot is None else flat.index_select(1, slot)


# ============================================================================ segment kernels
class _MathKernel:
    """Causal/full attention with lse in float32 matmuls (any device); the CPU path and the
    fallback. ``N`` is chunked so one chunk's scores stay under ``max_bytes``."""

    name = "math-fp32"

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes

    def _chunks(self, q):
        N, U, L, _ = q.shape
        step = max(1, self.max_bytes // max(1, U * L * L * 4))
        return range(0, N, step), step

    @staticmethod
    def _scores(q, k, causal, scale, group):
        kf = k.float().repeat_interleave(group, dim=1)
        s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [n, Uq, L, L]
        if causal:
            L = q.shape[2]
            s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1),
                              float("-inf"))
        return s, kf

    def forward(self, q, k, v, causal, scale, group):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        rng, step = self._chunks(q)
        for a in rng:
            b = a + step
            s, _ = self._scores(q[a:b], k[a:b], causal, scale, group)
            lse[a:b] = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse[a:b, ..., None])
            out[a:b] = torch.matmul(p, v[a:b].float().repeat_interleave(group, dim=1)).to(q.dtype)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, group):
        # FlashAttention-2 backward written out; out/lse are whatever the caller wants the
        # softmax normalised by (here: the merged output and lse of all configs).
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        rng, step = self._chunks(q)
        for a in rng:
            b = a + step
            s, kf = self._scores(q[a:b], k[a:b], causal, scale, group)
            p = torch.exp(s - lse[a:b, ..., None].float())  # [n, Uq, L, L]
            do = dout[a:b].float()
            vf = v[a:b].float().repeat_interleave(group, dim=1)
            dv_e = torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, vf.transpose(-1, -2))
            delta = (do * out[a:b].float()).sum(-1, keepdim=True)
            ds = p * (dp - delta)
            dq[a:b] = (torch.matmul(ds, kf) * scale).to(q.dtype)
            dk_e = torch.matmul(ds.transpose(-1, -2), q[a:b].float()) * scale
            n, uq, L, D = dk_e.shape
            dk[a:b] = dk_e.view(n, uq // group, group, L, D).sum(2).to(k.dtype)
            dv[a:b] = dv_e.view(n, uq // group, group, L, D).sum(2).to(v.dtype)
        return dq, dk, dv


class _FlashKernel:
    """PyTorch's fused flash-attention ops, which return the lse and accept it in the backward.

    CUDA: ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``); CPU:
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``). With
    ``expand_gqa`` K/V are repeated to the query heads (and dK/dV summed back) for builds whose
    op rejects fewer K/V heads.
    """

    def __init__(self, device_type: str, expand_gqa: bool = False):
        self.cuda = device_type == "cuda"
        self.expand_gqa = expand_gqa
        self.name = ("flash" if self.cuda else "flash-cpu") + ("+expand-kv" if expand_gqa else "")

    def _kv(self, k, v, group):
        if self.expand_gqa and group > 1:
            return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return k, v

    def forward(self, q, k, v, causal, scale, group):
        k, v = self._kv(k, v, group)
        if self.cuda:
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, group):
        ke, ve = self._kv(k, v, group)
        lse = lse.float().contiguous()
        if self.cuda:
            L = q.shape[2]
            empty = torch.empty(0, device=q.device, dtype=torch.int64)
            # cum_seq_* are unused (not varlen) and the philox state only matters with dropout.
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout.contiguous(), q, ke, ve, out.contiguous(), lse, empty, empty, L, L, 0.0,
                causal, empty, empty, scale=scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, ke, ve, out.contiguous(), lse, 0.0, causal, scale=scale)
        if self.expand_gqa and group > 1:
            n, uq, L, D = dk.shape
            dk = dk.view(n, uq // group, group, L, D).sum(2)
            dv = dv.view(n, uq // group, group, L, D).sum(2)
        return dq, dk, dv


_KERNEL_CACHE: dict = {}


def _pick_kernel(kernel: str, q: torch.Tensor, group: int, causal: bool):
    """The segment kernel for ``kernel`` ("auto", "flash", "math"); "auto" self-checks flash once
    per (device, dtype, head_dim, group, causal) against the float32 math kernel and falls back
    to expanded K/V, then to math, if the fused op errors or disagrees."""
    if kernel == "math":
        return _MathKernel()
    if kernel not in ("auto", "flash"):
        raise ValueError(f"kernel must be 'auto', 'flash' or 'math', got {kernel!r}")
    key = (q.device.type, q.dtype, q.shape[-1], group, causal)
    if key in _KERNEL_CACHE:
        return _KERNEL_CACHE[key]
    if kernel == "auto" and q.device.type == "cpu" and q.dtype != torch.float32:
        _KERNEL_CACHE[key] = _MathKernel()  # CPU flash in half precision is slow and untested
        return _KERNEL_CACHE[key]
    chosen = None
    for cand in (_FlashKernel(q.device.type), _FlashKernel(q.device.type, expand_gqa=True)):
        if _self_check(cand, q.device, q.dtype, q.shape[-1], group, causal):
            chosen = cand
            break
    if chosen is None:
        if kernel == "flash":
            raise RuntimeError(f"the fused flash op fails its self-check for {key}")
        chosen = _MathKernel()
    _KERNEL_CACHE[key] = chosen
    return chosen


def gather_kernel_names(q: torch.Tensor, plan: GatherPlan, *, causal: bool = True,
                        kernel: str = "auto") -> List[str]:
    """Names of the segment kernels :func:`gather_sdpa_attention` uses for ``q``'s device,
    dtype and head_dim with ``plan`` (after the one-time self-check)."""
    return sorted({_pick_kernel(kernel, q, c.group, causal).name for c in plan.configs})


def _self_check(cand, device, dtype, D, group, causal) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    N, uk, L = 3, 2, 97
    uq = uk * group
    q, k, v, do = rnd(N, uq, L, D), rnd(N, uk, L, D), rnd(N, uk, L, D), rnd(N, uq, L, D)
    scale = D ** -0.5
    ref = _MathKernel()
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    try:
        o, l = cand.forward(q, k, v, causal, scale, group)
        o_r, l_r = ref.forward(q, k, v, causal, scale, group)
        # Backward with a foreign (out, lse) pair, as the merge uses it: shift lse by a constant.
        l_b = l_r + 0.25
        g = cand.backward(do, q, k, v, o_r, l_b, causal, scale, group)
        g_r = ref.backward(do, q, k, v, o_r, l_b, causal, scale, group)
    except (RuntimeError, NotImplementedError, TypeError):
        return False

    def close(a, b):
        a, b = a.float(), b.float()
        return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm().clamp_min(1e-6)) < tol

    return close(o, o_r) and close(l, l_r) and all(close(a, b) for a, b in zip(g, g_r))


# ============================================================================ the op
class _GatherSDPA(torch.autograd.Function):
    """Forward: per config gather → fused attention (out, lse) → streaming LSE merge in float32.
    Backward: per config, the fused backward normalised by the *merged* (out, lse) — the exact
    gradient of the merged (double-counting) function, as in ring attention."""

    @staticmethod
    def forward(ctx, q, k, v, plan, causal, scale, kernel):
        B, hq, S, D = q.shape
        acc_o = torch.zeros(B, hq * S, D, dtype=torch.float32, device=q.device)
        acc_l = torch.full((B, hq * S), float("-inf"), dtype=torch.float32, device=q.device)
        kernels = []
        for i, c in enumerate(plan.configs):
            kern = _pick_kernel(kernel, q, c.group, causal)
            kernels.append(kern)
            qg = _gather(q, c.q_src, c.q_slot, c.nseg, c.uq, c.L)
            kg = _gather(k, c.k_src, c.k_slot, c.nseg, c.uk, c.L)
            vg = _gather(v, c.k_src, c.k_slot, c.nseg, c.uk, c.L)
            og, lg = kern.forward(qg, kg, vg, causal, scale, c.group)
            del qg, kg, vg
            o_i = _ungather(og, c.q_slot, B).float()  # [B, Nq, D]
            l_i = _ungather(lg, c.q_slot, B).float()  # [B, Nq]
            del og, lg
            if i == 0:
                acc_o.index_copy_(1, c.q_src, o_i)
                acc_l.index_copy_(1, c.q_src, l_i)
                continue
            # Each (head, position) appears at most once per config, so gather–merge–put is safe.
            l_old = acc_l.index_select(1, c.q_src)
            l_new = torch.logaddexp(l_old, l_i)
            o_new = acc_o.index_select(1, c.q_src) * torch.exp(l_old - l_new).unsqueeze(-1)
            o_new += o_i * torch.exp(l_i - l_new).unsqueeze(-1)
            acc_o.index_copy_(1, c.q_src, o_new)
            acc_l.index_copy_(1, c.q_src, l_new)
            del o_new, o_i, l_i, l_old, l_new
        out = acc_o.view(B, hq, S, D).to(q.dtype)
        lse = acc_l.view(B, hq, S)
        del acc_o
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.causal, ctx.scale, ctx.kernels = plan, causal, scale, kernels
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        B, hq, S, D = q.shape
        hkv = k.shape[1]
        dout = dout.to(q.dtype).contiguous()
        dq = torch.zeros(B, hq * S, D, dtype=torch.float32, device=q.device)
        dk = torch.zeros(B, hkv * S, D, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for c, kern in zip(plan.configs, ctx.kernels):
            qg = _gather(q, c.q_src, c.q_slot, c.nseg, c.uq, c.L)
            kg = _gather(k, c.k_src, c.k_slot, c.nseg, c.uk, c.L)
            vg = _gather(v, c.k_src, c.k_slot, c.nseg, c.uk, c.L)
            dog = _gather(dout, c.q_src, c.q_slot, c.nseg, c.uq, c.L)
            og = _gather(out, c.q_src, c.q_slot, c.nseg, c.uq, c.L)
            lg = _gather(lse, c.q_src, c.q_slot, c.nseg, c.uq, c.L)
            dqg, dkg, dvg = kern.backward(dog, qg, kg, vg, og, lg, ctx.causal, ctx.scale, c.group)
            del qg, kg, vg, dog, og, lg
            # index_add_: K units may repeat a (head, position) when gathered per query head.
            dq.index_add_(1, c.q_src, _ungather(dqg, c.q_slot, B).float())
            dk.index_add_(1, c.k_src, _ungather(dkg, c.k_slot, B).float())
            dv.index_add_(1, c.k_src, _ungather(dvg, c.k_slot, B).float())
            del dqg, dkg, dvg
        return (dq.view(B, hq, S, D).to(q.dtype), dk.view(B, hkv, S, D).to(k.dtype),
                dv.view(B, hkv, S, D).to(v.dtype), None, None, None, None)


def gather_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          pattern: DilatedPattern, *, causal: bool = True,
                          scale: Optional[float] = None, kernel: str = "auto",
                          plan: Optional[GatherPlan] = None, return_lse: bool = False):
    """The LongNet / torchscale gather → SDPA → LSE-merge attention (double-counts overlaps).

    Each config ``(w, r)`` is run as dense causal attention over every (segment, class) sub-
    sequence — head ``h`` uses class ``h % r`` (``per_head``) or every class (``all``) — and
    the per-config results are merged by their log-sum-exps. A key that several configs allow is
    counted once per config, so the result equals :func:`~hf_hilbert_attn.reference_attention`
    only when no pair is allowed by two configs (e.g. a single config); see
    :func:`double_counted_reference` for the function it does compute.

    Args:
        q: ``[B, Hq, S, D]``; k, v: ``[B, Hkv, S, D]`` (self-attention, natural order).
        pattern: the :class:`DilatedPattern`.
        causal: causal attention. Non-causal needs every segment whole and every rate dividing
            its segment (padding keys would otherwise be attended).
        scale: softmax scale (default ``D ** -0.5``).
        kernel: ``"auto"`` (fused flash op, self-checked, else float32 math), ``"flash"`` or
            ``"math"``.
        plan: a prebuilt :func:`build_gather_plan` (built here if ``None``).
        return_lse: also return the merged lse ``[B, Hq, S]`` (float32, not differentiable).

    Returns:
        ``out`` ``[B, Hq, S, D]`` in the input dtype (and ``lse``).

    Raises:
        ValueError: on bad shapes, ``Sq != Sk``, or non-causal attention that would need padding.
    """
    a = check_inputs(q, k, v, pattern, scale=scale)
    if a.sq != a.sk:
        raise ValueError(f"gather_sdpa_attention is self-attention only, got Sq={a.sq}, Sk={a.sk}")
    if plan is None:
        plan = build_gather_plan(pattern, a.sk, a.hq, a.hkv, q.device)
    elif (plan.seq_len, plan.hq, plan.hkv) != (a.sk, a.hq, a.hkv):
        raise ValueError(f"plan is for (S, Hq, Hkv) = {(plan.seq_len, plan.hq, plan.hkv)}, "
                         f"inputs are {(a.sk, a.hq, a.hkv)}")
    if not causal and plan.padded:
        raise ValueError(
            f"non-causal gather_sdpa_attention needs S ({a.sk}) to be a multiple of every segment "
            f"and every rate to divide its segment, got configs {list(pattern.configs)}")
    out, lse = _GatherSDPA.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, causal,
                                 a.scale, kernel)
    return (out, lse) if return_lse else out


def gather_pairs(pattern: DilatedPattern, seq_len: int, num_heads: int, *, causal: bool = True) -> int:
    """Pairs the gather baseline computes: the sum over configs (overlaps counted per config;
    no sink keys, no dense heads: the gather runs the configs alone)."""
    return sum(_single_config(pattern, w, r).count_pairs_total(seq_len, num_heads, causal=causal)
               for w, r in pattern.configs)


def _single_config(pattern: DilatedPattern, w: int, r: int) -> DilatedPattern:
    """``pattern`` restricted to its config ``(w, r)``, so its rule (pattern.py) gives that
    config's pairs alone. Skips validation on purpose: in per_head mode a lone config with
    ``r > 1`` is a legal *part* of a union but not a legal pattern (some queries see nothing)."""
    single = copy.copy(pattern)
    key = ((int(w),), (int(r),), pattern.query_dilation, 0, pattern.window, ())
    object.__setattr__(single, "segment_lengths", key[0])
    object.__setattr__(single, "dilation_rates", key[1])
    # the configs alone, as the gather computes: no sink keys, no dense heads (counting or
    # masking a pattern with dense heads would need the key/value head count, and the gather
    # runs every head sparse)
    object.__setattr__(single, "sink_tokens", 0)
    object.__setattr__(single, "dense_kv_heads", ())
    object.__setattr__(single, "_key", key)
    return single


def double_counted_reference(q, k, v, pattern: DilatedPattern, *, causal: bool = True,
                             scale: Optional[float] = None, return_lse: bool = False):
    """Dense float32 definition of what :func:`gather_sdpa_attention` computes.

    Softmax over keys with weight ``count(h, p, s) * exp(scale * q·k)``, where ``count`` is the
    number of configs that allow the pair (each config's rule from ``pattern.py``). O(S²): tests only.
    """
    a = check_inputs(q, k, v, pattern, scale=scale)
    count = None
    for w, r in pattern.configs:
        m = _single_config(pattern, w, r).build_mask(a.hq, a.q_positions, a.k_positions, causal=causal).float()
        count = m if count is None else count + m
    g = a.hq // a.hkv
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * a.scale + torch.log(count)  # log 0 = -inf
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), vf)
    return (out, lse) if return_lse else out


# ============================================================================ FlexAttention
class FlexDilated:
    """FlexAttention running ``pattern.mask_mod(causal)``; build and compile timed apart.

    Args:
        pattern: the :class:`DilatedPattern` (natural order: index == position).
        seq_len: ``S``; num_heads: ``Hq`` (the block mask is per head: per_head dilation).
        device: where the block mask is built.
        num_kv_heads: ``Hkv``, needed when the pattern has dense key/value heads (their query
            heads' mask rows are all allowed); default ``num_heads``.
        causal: causal mask.
        compile: wrap ``flex_attention`` in ``torch.compile`` (the only fast path; eager flex
            materialises the scores and is for tiny CPU checks).

    Attributes:
        build_s: seconds spent in ``create_block_mask`` (including its own compilation).
        compile_s: seconds of the first call made by :meth:`warm_up` (compile + one run).
    """

    def __init__(self, pattern: DilatedPattern, seq_len: int, num_heads: int, device,
                 *, causal: bool = True, compile: bool = True,
                 num_kv_heads: Optional[int] = None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        device = torch.device(device)
        kwargs = {}
        if compile and "_compile" in inspect.signature(create_block_mask).parameters:
            kwargs["_compile"] = True  # builds the mask without materialising [H, S, S]
        _sync(device)
        t0 = time.perf_counter()
        mask_mod = pattern.mask_mod(causal=causal, num_heads=num_heads,
                                    num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads)
        self.block_mask = create_block_mask(mask_mod, B=None, H=num_heads,
                                            Q_LEN=seq_len, KV_LEN=seq_len, device=device, **kwargs)
        _sync(device)
        self.build_s = time.perf_counter() - t0
        self.compile_s = float("nan")
        self._fn = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    def __call__(self, q, k, v):
        return self._fn(q, k, v, block_mask=self.block_mask,
                        enable_gqa=q.shape[1] != k.shape[1])

    def warm_up(self, q, k, v, dout=None):
        """First call (compiles forward, and backward when ``dout`` is given); sets ``compile_s``."""
        _sync(q.device)
        t0 = time.perf_counter()
        out = self(q, k, v)
        if dout is not None:
            out.backward(dout)
        _sync(q.device)
        self.compile_s = time.perf_counter() - t0
        return out


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
