"""Decoding: a few queries against a key/value cache, as one plan per forward and one run per
layer (the plan/run split of ``docs/kernels.md``, "Decoding").

Every layer of a decode step attends at the same positions, so what follows from them — the
positions of the queries and of the cached keys, documents, padding — is gathered once, by
:func:`plan_decode`, into a :class:`DecodePlan`, and turned into device tensors by its first
run. :func:`run_decode` then launches the decode kernel once per layer (``kernels._decode``:
split over keys, the pattern's rule evaluated per key tile from the positions, tiles no query
attends never loaded; on a CPU, one fused SDPA call with the plan's bias as its mask). Dense
key/value heads are a table of the same launch, so they cost no second call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from .engines.tiles import _FLASH_FWD as _SDPA_CPU  # (SDPA's fused CPU kernel)
from .inputs import KERNEL_DTYPES as _DTYPES, KERNEL_HEAD_DIMS
from .pattern import DilatedPattern
from .plan_cache import memoised

__all__ = ["DECODE_MAX_QUERIES", "DecodePlan", "plan_decode", "run_decode", "decodes",
           "PreparedDecode"]

DECODE_MAX_QUERIES = 16  # queries per call (decoding, speculative decoding); more: the op
CPU_KEY_RATIO = 2.0  # on a CPU: cached keys per key the pattern reads, at most (D35)
_MAX_ROWS = 128  # (Hq // Hkv) * Sq rows of the kernel's tile


@dataclass(eq=False)
class DecodePlan:
    """What every layer of a decode step with one pattern reads: the pattern, the head counts,
    the positions ``[Sq]`` / ``[B, Sq]`` of the queries and ``[Sk]`` / ``[B, Sk]`` of the cached
    keys (true positions, slot order) and their document ids (a negative key id: padding), or,
    in a cache's own layout, the first query's position ``q_positions`` (an int: the queries
    follow it, in slots past the sinks) and the keys ``dropped`` after the sink tokens
    (``k_positions`` None: slot ``j`` at ``j``, past the sinks ``j + dropped``). Its first run
    makes what a run needs: on CUDA the kernel's ``Rule`` (int32 rows per batch row, or none in
    a cache's layout; the configs and dense key/value heads as small tables) and launch, on a
    CPU the float32 bias (0 allowed, -inf not, ``[Bm, Hkv, (Hq // Hkv) * Sq, Sk]``)."""

    pattern: DilatedPattern
    num_heads: int
    num_kv_heads: int
    sk: int
    q_positions: Union[torch.Tensor, int]
    k_positions: Optional[torch.Tensor]
    q_doc_ids: Optional[torch.Tensor] = None
    k_doc_ids: Optional[torch.Tensor] = None
    dropped: int = 0
    _made: Optional[object] = None  # the launcher or the bias, made by the first run

    @property
    def in_cache_layout(self) -> bool:
        """Whether the positions follow the cache's slots (no position tensors)."""
        return self.k_positions is None

    def positions(self, sq: int, device) -> tuple:
        """``(q_positions, k_positions)`` as tensors for ``sq`` queries."""
        if not self.in_cache_layout:
            return self.q_positions, self.k_positions
        slots = torch.arange(self.sk, device=device)
        return (torch.arange(sq, device=device) + self.q_positions,
                torch.where(slots < self.pattern.sink_tokens, slots, slots + self.dropped))

    def rule(self, batch: int, sq: int, device):
        """The kernel's ``Rule`` of this plan for ``batch`` rows of ``sq`` queries, with position
        rows (made anew each call)."""
        from .kernels._decode import Rule  # imports Triton: on the first decode call

        cfg, dense = _tables(self.pattern, self.num_kv_heads, device)
        qp, kp = self.positions(sq, device)
        qp, kp, qd, kd = (None if t is None else t.to(torch.int32).expand(batch, -1).contiguous()
                          for t in (qp, kp, self.q_doc_ids, self.k_doc_ids))  # [batch, S] int32
        return Rule(qp, kp, qp if qd is None else qd, kp if kd is None else kd, cfg, dense,
                    self.pattern.sink_tokens)

    def bias(self, sq: int, device) -> torch.Tensor:
        """The CPU run's float32 bias (``build_mask`` over the positions, dense heads included)."""
        allowed = self.pattern.build_mask(self.num_heads, *self.positions(sq, device),
                                          q_doc_ids=self.q_doc_ids, k_doc_ids=self.k_doc_ids,
                                          num_kv_heads=self.num_kv_heads)  # [Bm, Hq, Sq, Sk]
        rows = allowed.reshape(allowed.shape[0], self.num_kv_heads, -1, allowed.shape[-1])
        return rows.new_zeros(rows.shape, dtype=torch.float32).masked_fill_(~rows, float("-inf"))


_TABLES: dict = {}  # (pattern, Hkv, device) -> the kernel's config and dense-head tables


def _tables(pattern: DilatedPattern, num_kv_heads: int, device) -> tuple:
    """``Rule.CFG`` and ``Rule.DENSE`` of ``pattern``: made once per device (a copy to the
    device waits for it), afresh while tracing."""
    def make():
        pattern.check_kv_heads(num_kv_heads)
        cfgs = list(pattern.configs)
        cfgs += cfgs[:1] * ((1 << (len(cfgs) - 1).bit_length()) - len(cfgs))
        return (torch.tensor(cfgs, dtype=torch.int32, device=device),
                torch.tensor([j in pattern.dense_kv_heads for j in range(num_kv_heads)],
                             dtype=torch.int8, device=device))

    if torch.compiler.is_compiling():  # (a traced graph's tensors stay in the graph)
        return make()
    return memoised(_TABLES, (pattern, num_kv_heads, device), 64, make)


def decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: DilatedPattern,
            softcap: Optional[float] = None) -> bool:
    """Whether a call of ``q`` ``[B, Hq, Sq, D]`` against ``k``/``v`` ``[B, Hkv, Sk, D]`` is a
    decode call :func:`run_decode` takes: at most ``DECODE_MAX_QUERIES`` queries, no gradient
    to record, one supported dtype, equal head dims; on CUDA (or in Triton's interpreter where
    asked: ``HF_HILBERT_DECODE_KERNEL=1``, tests) the kernel's head dims and tile; on a CPU,
    which reads every key, while ``pattern`` reads at least ``1 / CPU_KEY_RATIO`` of them (else the op's
    blockwise path, which reads only those, is faster: docs/decisions.md D35, D50) and the
    scores are not soft-capped (``softcap``: SDPA cannot)."""
    sq, hq, hkv, sk = q.shape[2], q.shape[1], k.shape[1], k.shape[2]
    kernel = _kernel(q)
    reads = sum(min(w, sk) // r for w, r in pattern.configs) + pattern.sink_tokens
    return ((kernel or q.device.type == "cpu" and _SDPA_CPU is not None and not softcap
             and sk <= CPU_KEY_RATIO * reads)
            and 0 < sq <= DECODE_MAX_QUERIES and k.shape[2] > 0 and q.dtype == k.dtype == v.dtype
            and q.dtype in _DTYPES and q.shape[-1] == v.shape[-1] and hkv > 0 and hq % hkv == 0
            and (not kernel or q.shape[-1] in KERNEL_HEAD_DIMS and (hq // hkv) * sq <= _MAX_ROWS)
            and not (torch.is_grad_enabled()
                     and (q.requires_grad or k.requires_grad or v.requires_grad)))


def _kernel(q: torch.Tensor) -> bool:
    """Whether the decode kernel runs (CUDA, or the interpreter where asked); else PyTorch."""
    return q.is_cuda or (os.environ.get("HF_HILBERT_DECODE_KERNEL") == "1"
                         and os.environ.get("TRITON_INTERPRET") == "1")


def plan_decode(pattern: DilatedPattern, num_heads: int, num_kv_heads: int, sk: int,
                q_positions: Union[torch.Tensor, int], k_positions: Optional[torch.Tensor], *,
                q_doc_ids: Optional[torch.Tensor] = None,
                k_doc_ids: Optional[torch.Tensor] = None, dropped: int = 0) -> DecodePlan:
    """The plan of a causal decode step (:class:`DecodePlan`); no device work until its first
    run, which is O(B · (Sq + Sk)) on CUDA (the rule is evaluated in the kernel). In a cache's
    own layout (``q_positions`` the first query's position, ``k_positions`` None, ``dropped``
    keys after the sink tokens) none at all: on CUDA every step of a generation then relaunches
    one kernel."""
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together")
    if (k_positions is None) != isinstance(q_positions, int) or \
            k_positions is None and q_doc_ids is not None:
        raise ValueError("an int q_positions (the cache's own layout) goes with k_positions=None "
                         "and no document ids; tensors with tensors")
    return DecodePlan(pattern, num_heads, num_kv_heads, sk, q_positions, k_positions, q_doc_ids,
                      k_doc_ids, dropped)


def run_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan,
               scale: float, return_lse: bool = False, softcap: Optional[float] = None):
    """Attention of ``q`` ``[B, Hq, Sq, D]`` over ``k``/``v`` ``[B, Hkv, Sk, D]`` as ``plan``
    allows (a query with none: output 0, lse -inf), scores soft-capped at ``softcap`` if given
    (a call :func:`decodes` takes): the decode kernel, one launch. Returns
    ``out`` (a ``[B, Hq, Sq, D]`` view of ``[B, Sq, Hq, D]`` storage: the layout a model wants
    back) and ``lse`` ``[B, Hq, Sq]`` float32 if asked. Under ``torch.compile`` (``out`` only)
    one custom op, which CUDA graphs capture."""
    if k.shape[2] != plan.sk:
        raise ValueError(f"decode plan made for {plan.sk} keys, called with {k.shape[2]}")
    (b, hq, sq, d), p = q.shape, plan.pattern
    if not _kernel(q):  # (traced as it is under torch.compile)
        if softcap:
            raise ValueError("soft-capped decoding runs on the decode kernel (CUDA) only "
                             "(decodes() says which calls run_decode takes)")
        if plan._made is None:
            plan._made = plan.bias(sq, q.device)
        out, lse = _torch_decode(q, k, v, plan._made, scale)
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling() and not return_lse:
        r = plan.rule(b, sq, q.device)
        return torch.ops.hf_hilbert_attn.decode(
            q, k, v, r.QP, r.KP, r.QD if plan.q_doc_ids is not None else None, r.KD, r.CFG,
            r.DENSE, r.SINKS, p.sliding, p.query_dilation == "per_head", float(scale),
            float(softcap or 0.0))
    if plan._made is None:
        plan._made = _launcher(plan, q)
    out = q.new_empty_strided(q.shape, (sq * hq * d, d, hq * d, 1))  # [B, Sq, Hq, D] storage
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device) if return_lse else None
    plan._made(q, k, v, scale, out, lse, interpret=not q.is_cuda, softcap=softcap or 0.0,
               qbase=0 if not plan.in_cache_layout else plan.q_positions, kdrop=plan.dropped)
    return (out, lse) if return_lse else out


class PreparedDecode:
    """The prepared run of ``run_decode(q, k, v, plan, scale, softcap=softcap)`` (``out``
    only), made once that call ran eagerly on the decode kernel (``plan`` has its launcher): a
    decode step's later layers call it on inputs that ``fits`` it, with no checks, plan lookup
    or routing."""

    __slots__ = ("launch", "inputs", "scale", "softcap", "qbase", "kdrop")

    def __init__(self, q, k, v, plan: DecodePlan, scale: float, softcap: Optional[float]):
        self.launch, self.scale, self.softcap = plan._made, float(scale), float(softcap or 0.0)
        self.inputs = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device)
        self.qbase, self.kdrop = (plan.q_positions if plan.in_cache_layout else 0), plan.dropped

    def fits(self, q, k, v, scale=None, softcap=None) -> bool:
        """Whether ``q``, ``k``, ``v`` are inputs like this call's with its ``scale`` and
        ``softcap``, and no gradient is recorded (what :func:`decodes` checks per call)."""
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device) == self.inputs \
            and (q.shape[-1] ** -0.5 if scale is None else scale) == self.scale \
            and (softcap or 0.0) == self.softcap and not (torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad))

    def __call__(self, q, k, v):
        (_, hq, sq, d) = q.shape
        out = q.new_empty_strided(q.shape, (sq * hq * d, d, hq * d, 1))  # [B, Sq, Hq, D] storage
        self.launch(q, k, v, self.scale, out, None, interpret=not q.is_cuda,
                    softcap=self.softcap, qbase=self.qbase, kdrop=self.kdrop)
        return out


_LAUNCHERS: dict = {}  # launchers of plans in a cache's layout, by pattern, heads and stream


def _launcher(plan: DecodePlan, q: torch.Tensor):
    """The kernel's launcher of ``plan``: its own where it has position rows, else the one that
    every plan of this pattern and head counts on this stream shares (its kernel, workspace and
    counters made once for a generation)."""
    from .kernels._decode import DecodeLauncher, Rule

    p, b, sq = plan.pattern, q.shape[0], q.shape[2]
    flags = (p.sliding, p.query_dilation == "per_head", plan.q_doc_ids is not None)
    if not plan.in_cache_layout:
        return DecodeLauncher(plan.rule(b, sq, q.device), *flags)
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None
    key = (p, plan.num_heads, plan.num_kv_heads, q.device, stream)
    cfg, dense = _tables(p, plan.num_kv_heads, q.device)
    return memoised(_LAUNCHERS, key, 64, lambda: DecodeLauncher(
        Rule(cfg, cfg, cfg, cfg, cfg, dense, p.sink_tokens), *flags, positions=False,
        windows=tuple(w for w, _ in p.configs), dense=bool(p.dense_kv_heads)))


def _torch_decode(q, k, v, bias: torch.Tensor, scale: float):
    """:func:`run_decode` off CUDA: one fused SDPA call per layer with the plan's bias as its
    float mask, the query heads of a key/value head as rows (in float32; float64 stays)."""
    (b, hq, sq, d), hkv = q.shape, k.shape[1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    bias = bias.to(cdt)
    out, lse = _SDPA_CPU(q.to(cdt).reshape(b, hkv, hq // hkv * sq, d), k.to(cdt), v.to(cdt),
                         0.0, False, attn_mask=bias, scale=scale)
    # (a row with no allowed key: SDPA gives out 0 and lse 0; the contract says -inf)
    lse = lse.float().masked_fill(torch.isneginf(bias).all(-1), float("-inf"))
    return out.to(q.dtype).reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


@torch.library.custom_op("hf_hilbert_attn::decode", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               k_pos: torch.Tensor, q_doc: Optional[torch.Tensor], k_doc: torch.Tensor,
               cfg: torch.Tensor, dense: torch.Tensor, sinks: int, sliding: bool,
               per_head: bool, scale: float, softcap: float) -> torch.Tensor:
    from .kernels._decode import DecodeLauncher, Rule

    (b, hq, sq, d), rule = q.shape, Rule(q_pos, k_pos, q_pos if q_doc is None else q_doc, k_doc,
                                         cfg, dense, sinks)
    out = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    DecodeLauncher(rule, sliding, per_head, q_doc is not None)(
        q, k, v, scale, out, interpret=not q.is_cuda, softcap=softcap)
    return out


@_decode_op.register_fake
def _(q, *args):
    (b, hq, sq, d) = q.shape
    return q.new_empty(b, sq, hq, d).transpose(1, 2)
