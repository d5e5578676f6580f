"""The dilated attention pattern: the one place that defines which pairs are allowed
(README, "The pattern").

A pattern is a list of configs ``(w_i, r_i)`` (segment length, dilation rate). For query head
``h``, query position ``p`` and key position ``s`` (true positions, not storage indices):

* ``seg_i(x) = x // w_i`` and ``t_i(x) = x % w_i``;
* ``per_head`` query dilation: config ``i`` allows the pair iff ``seg_i(p) == seg_i(s)`` and
  ``t_i(p) % r_i == t_i(s) % r_i == h % r_i``;
* ``all`` query dilation: iff ``seg_i(p) == seg_i(s)`` and ``t_i(p) % r_i == t_i(s) % r_i``;
* ``window="sliding"`` replaces the fixed segments by a window ending at the query: config ``i``
  allows ``0 <= p - s < w_i`` (non-causal ``|p - s| < w_i``) with ``p ≡ s (mod r_i)`` and,
  per_head, ``p ≡ h (mod r_i)``; there are no segment boundaries;
* ``sink_tokens = k``: keys at positions ``< k`` are allowed for every query and head;
* ``dense_kv_heads = (j, ...)``: every query head that reads key/value head ``j``
  (``h // (Hq // Hkv) == j``) is allowed every key (plain attention: causality, documents and
  padding still apply);
* the pattern allows the pair iff *any* config (or the sink rule) does (a union: a key counts
  once);
* causal attention additionally needs ``s <= p``; keys of another document, or padding, never.

Inside one segment ``t(p) - t(s) == p - s``, so ``t(p) % r == t(s) % r`` is ``p ≡ s (mod r)``:
both modes reduce to "same segment and ``p ≡ s (mod r)``", per_head adding that the query's own
class is ``h % r``. ``count_pairs`` and the kernels rely on that identity. A sliding config is
the same with the segment replaced by the window (classes are ``p % r``, global).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import yaml

from . import counting
from .planning import covers, replaced

QUERY_DILATION_MODES = ("per_head", "all")
ORDERINGS = ("natural", "hilbert", "auto")
WINDOWS = ("segment", "sliding")
# What a pattern dict (YAML, config.json) without these fields means: the patterns written
# before the fields existed keep their meaning whatever the constructor defaults become.
LEGACY_FIELDS = {"sink_tokens": 0, "window": "segment", "dense_kv_heads": ()}

__all__ = ["DilatedPattern", "QUERY_DILATION_MODES", "ORDERINGS", "WINDOWS"]


def _as_int(v, error: str, minimum: float = -math.inf) -> int:
    # integral floats / numpy ints from YAML or configs are accepted, anything else raises
    try:  # (an infinite float: OverflowError)
        as_int = None if isinstance(v, bool) else int(v)
    except (TypeError, ValueError, OverflowError):
        as_int = None
    if as_int is None or as_int != v or as_int < minimum:
        raise ValueError(f"{error}, got {v!r}")
    return as_int


def _as_int_tuple(name: str, values) -> tuple:
    try:
        if isinstance(values, (int, str)) or values is None:
            raise TypeError
        values = tuple(values)
    except TypeError:
        raise ValueError(f"{name} must be a non-empty list of integers, got {values!r}") from None
    return tuple(_as_int(v, f"{name}[{i}] must be an integer") for i, v in enumerate(values))


@dataclass(frozen=True)
class DilatedPattern:
    """A LongNet-style dilated attention pattern.

    Args:
        segment_lengths: ``w_i`` for each config, each ``>= 1``.
        dilation_rates: ``r_i`` for each config, ``1 <= r_i <= w_i``.
        query_dilation: ``"per_head"`` (head ``h`` uses class ``h % r_i``; LongNet) or ``"all"``
            (every query uses every config with its own class).
        ordering: storage layout of tokens (``"natural"``, ``"hilbert"``, ``"auto"``), honoured
            for self-attention over ``0..S-1``; never part of the rule (equality, hash).
        sink_tokens: ``k >= 0``: keys at positions ``< k`` (of the query's own document) are
            allowed for every query and head (attention sinks; 0 = none).
        window: ``"segment"`` (fixed segments of ``w_i``, LongNet) or ``"sliding"`` (config
            ``i`` allows keys less than ``w_i`` positions before the query, same class).
        dense_kv_heads: key/value head indices whose query heads attend every key (retrieval
            heads; stored sorted, checked against ``Hkv`` by :meth:`check_kv_heads`).

    Raises:
        ValueError: naming the bad field and value.
    """

    segment_lengths: tuple
    dilation_rates: tuple
    query_dilation: str = "per_head"
    ordering: str = field(default="natural", compare=False)
    sink_tokens: int = 0
    window: str = "segment"
    dense_kv_heads: tuple = ()
    _key: tuple = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        w = _as_int_tuple("segment_lengths", self.segment_lengths)
        r = _as_int_tuple("dilation_rates", self.dilation_rates)
        for name, values in (("segment_lengths", w), ("dilation_rates", r)):
            if not values:
                raise ValueError(f"{name} must be non-empty, got []")
        if len(w) != len(r):
            raise ValueError(
                f"segment_lengths and dilation_rates must have equal length, got {len(w)} "
                f"segment_lengths {list(w)} and {len(r)} dilation_rates {list(r)}")
        for i, (wi, ri) in enumerate(zip(w, r)):
            for name, x in (("segment_lengths", wi), ("dilation_rates", ri)):
                if x < 1:
                    raise ValueError(f"{name}[{i}] must be >= 1, got {x}")
            if ri > wi:
                raise ValueError(
                    f"dilation_rates[{i}] must be <= segment_lengths[{i}] = {wi}, got {ri}")
        for name, choices in (("query_dilation", QUERY_DILATION_MODES), ("ordering", ORDERINGS),
                              ("window", WINDOWS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        sink = _as_int(self.sink_tokens, "sink_tokens must be an integer >= 0", 0)
        dense = self.dense_kv_heads
        if isinstance(dense, (int, str)) or dense is None:
            raise ValueError(f"dense_kv_heads must be a list of key/value head indices, "
                             f"got {dense!r}")
        dense = _as_int_tuple("dense_kv_heads", dense) if len(tuple(dense)) else ()
        if any(j < 0 for j in dense):
            raise ValueError(f"dense_kv_heads must be >= 0, got {list(dense)}")
        if len(set(dense)) != len(dense):
            raise ValueError(f"dense_kv_heads must not repeat a head, got {list(dense)}")
        dense = tuple(sorted(dense))
        if self.query_dilation == "per_head" and 1 not in r:
            raise ValueError(
                f"dilation_rates must contain a 1 in per_head mode (otherwise some queries attend "
                f"nothing), got {list(r)}; add a config with rate 1 or use query_dilation='all'")
        _warn_covered(w, r, self.window == "sliding")
        # the rule's identity (equality, hash): every field but the storage layout
        key = (w, r, self.query_dilation, sink, self.window, dense)
        for name, value in dict(segment_lengths=w, dilation_rates=r, sink_tokens=sink,
                                dense_kv_heads=dense, _key=key).items():
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction / IO
    @classmethod
    def dense(cls, max_length: int, **kwargs) -> "DilatedPattern":
        """The pattern equal to plain (causal) attention for positions ``< max_length``."""
        return cls([int(max_length)], [1], **kwargs)

    @classmethod
    def from_dict(cls, d: dict) -> "DilatedPattern":
        if isinstance(d, DilatedPattern):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"a pattern dict is needed, got {type(d).__name__}: {d!r}")
        known = {"segment_lengths", "dilation_rates", "query_dilation", "ordering", "sink_tokens",
                 "window", "dense_kv_heads"}
        if unknown := set(d) - known - {"description"}:
            raise ValueError(f"unknown pattern field(s) {sorted(unknown)}; known: {sorted(known)}")
        for req in ("segment_lengths", "dilation_rates"):
            if req not in d:
                raise ValueError(f"pattern is missing the field {req!r}: {d!r}")
        # an older dict keeps meaning what it meant
        return cls(**{**LEGACY_FIELDS, **{k: v for k, v in d.items() if k in known}})

    def to_dict(self) -> dict:
        d = {"segment_lengths": list(self.segment_lengths),
             "dilation_rates": list(self.dilation_rates), "query_dilation": self.query_dilation,
             "ordering": self.ordering, "sink_tokens": self.sink_tokens, "window": self.window}
        if self.dense_kv_heads:  # absent means none: older readers and files agree
            d["dense_kv_heads"] = list(self.dense_kv_heads)
        return d

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "DilatedPattern":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"pattern file not found: {path}")
        return cls.from_dict(yaml.safe_load(path.read_text()))

    def to_yaml(self, path: Union[str, Path, None] = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            Path(path).write_text(text)
        return text

    def replace(self, **kwargs) -> "DilatedPattern":
        return DilatedPattern.from_dict({**self.to_dict(), **kwargs})

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, DilatedPattern) and self._key == other._key

    def __str__(self):
        cfg = ", ".join(f"({w},{r})" for w, r in zip(self.segment_lengths, self.dilation_rates))
        extra = "" if self.window == "segment" else ", sliding"
        extra += f", sinks={self.sink_tokens}" if self.sink_tokens else ""
        extra += f", dense kv heads {list(self.dense_kv_heads)}" if self.dense_kv_heads else ""
        return f"DilatedPattern[{cfg}; {self.query_dilation}, {self.ordering}{extra}]"

    # ------------------------------------------------------------------ properties
    @property
    def num_configs(self) -> int:
        return len(self.segment_lengths)

    @property
    def configs(self) -> tuple:
        return tuple(zip(self.segment_lengths, self.dilation_rates))

    @property
    def max_segment(self) -> int:
        return max(self.segment_lengths)

    @property
    def max_rate(self) -> int:
        return max(self.dilation_rates)

    @property
    def sliding(self) -> bool:
        return self.window == "sliding"

    @property
    def sparse_part(self) -> "DilatedPattern":
        """The pattern without its dense heads (what the sparse engines compute)."""
        return self if not self.dense_kv_heads else replaced(self, self.ordering, dense_kv_heads=())

    def check_kv_heads(self, num_kv_heads: int) -> None:
        """``ValueError`` unless every dense key/value head exists (``< num_kv_heads``)."""
        if bad := [j for j in self.dense_kv_heads if j >= num_kv_heads]:
            raise ValueError(f"dense_kv_heads {list(self.dense_kv_heads)} name key/value head(s) "
                             f"{bad}, but the model has {num_kv_heads} (valid: 0..{num_kv_heads - 1})")

    def dense_query_heads(self, num_heads: int, num_kv_heads: Optional[int]) -> torch.Tensor:
        """``[num_heads]`` bool: query heads that read a dense key/value head."""
        if not self.dense_kv_heads:
            return torch.zeros(num_heads, dtype=torch.bool)
        if num_kv_heads is None:
            raise ValueError("this pattern has dense_kv_heads: pass num_kv_heads (the number of "
                             "key/value heads) so query heads can be mapped to them")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads "
                             f"({num_kv_heads})")
        self.check_kv_heads(num_kv_heads)
        kv = torch.arange(num_heads) // (num_heads // num_kv_heads)
        return torch.isin(kv, torch.tensor(self.dense_kv_heads, dtype=kv.dtype))

    @property
    def shift_period(self) -> int:
        """Shifting every position by a multiple of this leaves the configs' rule unchanged (not
        the sinks'): the lcm of the segment lengths (sliding: of the rates)."""
        return math.lcm(*(self.dilation_rates if self.sliding else self.segment_lengths))

    def first_needed_key(self, position: int, num_heads: Optional[int] = None) -> int:
        """The oldest key a causal query at ``position`` or later can still attend through a
        config (sinks aside): a KV cache may drop ``[sink_tokens, first_needed_key(position))``.
        ``position`` when no older key is needed. Exact: some later query of some head ``<
        num_heads`` (None: every class has a head) attends the returned key.
        """
        first = p = int(position)
        for w, r in self.configs:
            heads = r if num_heads is None or self.query_dilation == "all" else min(r, num_heads)
            if self.sliding:  # the nearest later query of class c reaches back (w-1)//r steps
                for c in range(heads):
                    s = p + (c - p) % r - (w - 1) // r * r
                    first = min(first, s if s >= 0 else c)
            else:  # later queries of p's segment, offsets t(p)..w-1; keys of their classes
                t = p % w
                classes = range(heads) if w - t >= r else [x % r for x in range(t, w)
                                                           if x % r < heads]
                first = min(first, p - t + min(classes, default=t))
        return min(first, p)

    def cache_reach(self, num_heads: Optional[int] = None, align: int = 1) -> int:
        """The most keys above the sinks that a cache keeping ``[a, p)`` holds before the query
        at ``p``, over every ``p``, where ``a`` is :meth:`first_needed_key` rounded down to a
        multiple of ``align``; at most ``max_segment - 1 + align - 1``, and exact (reached)
        where one period of the pattern is short enough to scan."""
        per = math.lcm(self.shift_period, align)
        if not self.sliding and align == self.max_segment == per:
            return self.max_segment - 1  # nested segments: a cache keeps its longest segment
        if per * (sum(self.dilation_rates) if self.sliding else self.num_configs) > 1 << 16:
            return self.max_segment - 1 + align - 1  # too long to scan: the upper bound
        base = -(-(2 * self.max_segment + align) // per) * per  # past every clamp at 0
        return max(p - self.first_needed_key(p, num_heads) // align * align
                   for p in range(base, base + per))

    def is_dense_for(self, length: int) -> bool:
        """True if the pattern allows every (causal) pair among positions ``< length``."""
        return length <= self.sink_tokens or any(w >= length and r == 1 for w, r in self.configs)

    # ------------------------------------------------------------------ the rule
    def segment_and_class(self, i: int, pos) -> tuple:
        """Config ``i``'s segment ``pos // w_i`` and dilation class ``(pos % w_i) % r_i``
        (elementwise on integer tensors): the config allows only pairs that agree in both.
        Sliding windows: segment 0, class ``pos % r_i``; the window is :meth:`in_window`.
        """
        w, r = self.configs[i]
        pos = torch.as_tensor(pos)
        if self.sliding:  # no segments: one group per class p % r (the window is separate)
            return torch.zeros_like(pos), torch.remainder(pos, r)
        return torch.div(pos, w, rounding_mode="floor"), torch.remainder(pos, w) % r

    def config_keys(self, i: int, head, q_pos, k_pos) -> tuple:
        """Integer keys with ``config_allowed(i, head, p, s) == (q_key == k_key)`` (broadcast;
        sliding windows: the class only): ``2 * (segment * r_i + class)``, per_head ``+ 1`` for
        a query whose class is not its head's ``h % r_i``. One comparison instead of three.
        """
        r = self.dilation_rates[i]
        (q_seg, q_cls), (k_seg, k_cls) = (self.segment_and_class(i, p) for p in (q_pos, k_pos))
        q_key, k_key = (q_seg * r + q_cls) * 2, (k_seg * r + k_cls) * 2
        if r > 1 and self.query_dilation == "per_head":
            q_key = q_key + (q_cls != torch.remainder(torch.as_tensor(head), r)).to(q_key.dtype)
        return q_key, k_key

    def config_allowed(self, i: int, head, q_pos, k_pos) -> torch.Tensor:
        """The rule of config ``i`` alone, on broadcastable integer tensors (no head dimension
        where it does not depend on the head); :meth:`allowed` is the OR over the configs."""
        q_key, k_key = self.config_keys(i, head, q_pos, k_pos)
        ok = q_key == k_key
        return ok & self.in_window(i, q_pos, k_pos) if self.sliding else ok

    def in_window(self, i: int, q_pos, k_pos) -> torch.Tensor:
        """Sliding windows: ``|p - s| < w_i`` (causality, ``s <= p``, is applied apart)."""
        return (torch.as_tensor(q_pos) - torch.as_tensor(k_pos)).abs() < self.segment_lengths[i]

    def sink_allowed(self, k_pos) -> torch.Tensor:
        """The sink rule: key position ``< sink_tokens`` (any query, any head)."""
        return torch.as_tensor(k_pos) < self.sink_tokens

    def allowed(self, head, q_pos, k_pos, *, num_heads: Optional[int] = None,
                num_kv_heads: Optional[int] = None) -> torch.Tensor:
        """Allowed-pair rule on broadcastable integer tensors (no causality, no documents):
        the union of the configs, the sink rule and the dense heads (those need ``num_heads``
        and ``num_kv_heads`` to map a query head to its key/value head)."""
        out = reduce(torch.logical_or, (self.config_allowed(i, head, q_pos, k_pos)
                                        for i in range(self.num_configs)))
        out = out | self.sink_allowed(k_pos) if self.sink_tokens else out
        if self.dense_kv_heads:
            if num_heads is None:
                raise ValueError("this pattern has dense_kv_heads: pass num_heads and "
                                 "num_kv_heads so query heads can be mapped to them")
            dense = self.dense_query_heads(num_heads, num_kv_heads).to(out.device)
            out = out | dense[torch.as_tensor(head, device=out.device)]
        return out

    def build_mask(self, num_heads: int, q_positions: torch.Tensor, k_positions: torch.Tensor, *,
                   causal: bool = True, q_doc_ids: Optional[torch.Tensor] = None,
                   k_doc_ids: Optional[torch.Tensor] = None,
                   num_kv_heads: Optional[int] = None) -> torch.Tensor:
        """Dense boolean mask ``[B, H, Sq, Sk]`` (True = attend), O(Sq*Sk): for references,
        tests and small masks. Positions and document ids ``[S]`` or ``[B, S]``; a negative key
        document id is padding. ``num_kv_heads``: needed when the pattern has dense heads.
        """
        qp, kp = _as_2d(q_positions), _as_2d(k_positions)
        h = torch.arange(num_heads, device=qp.device).view(1, num_heads, 1, 1)
        qp4, kp4 = qp[:, None, :, None], kp[:, None, None, :]
        mask = self.allowed(h, qp4, kp4, num_heads=num_heads, num_kv_heads=num_kv_heads)
        mask = mask & (kp4 <= qp4) if causal else mask
        if q_doc_ids is not None or k_doc_ids is not None:
            if q_doc_ids is None or k_doc_ids is None:
                raise ValueError("q_doc_ids and k_doc_ids must be given together")
            qd, kd = _as_2d(q_doc_ids)[:, None, :, None], _as_2d(k_doc_ids)[:, None, None, :]
            mask = mask & (qd == kd) & (kd >= 0)
        batch = max(qp.shape[0], kp.shape[0], mask.shape[0])
        return mask.expand(batch, num_heads, qp.shape[1], kp.shape[1])

    def mask_mod(self, causal: bool = True, q_positions: Optional[torch.Tensor] = None,
                 k_positions: Optional[torch.Tensor] = None,
                 q_doc_ids: Optional[torch.Tensor] = None,
                 k_doc_ids: Optional[torch.Tensor] = None, num_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None) -> Callable:
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for this pattern; position
        and document tensors (``[S]`` or ``[B, S]``; none: index == position) are indexed with
        the storage indices it passes in. ``num_heads`` / ``num_kv_heads``: for dense heads.
        """
        if self.dense_kv_heads:
            self.dense_query_heads(num_heads, num_kv_heads)  # (checks the head counts now)
        qp, kp, qd, kd = (None if t is None else _as_2d(t)
                          for t in (q_positions, k_positions, q_doc_ids, k_doc_ids))

        def _pick(t, b, idx):
            return t[b % t.shape[0] if t.shape[0] > 1 else 0, idx]

        def mask_mod(b, h, q_idx, kv_idx):
            p = q_idx if qp is None else _pick(qp, b, q_idx)
            s = kv_idx if kp is None else _pick(kp, b, kv_idx)
            ok = self.allowed(h, p, s, num_heads=num_heads, num_kv_heads=num_kv_heads)
            ok = ok & (s <= p) if causal else ok
            if qd is not None:
                dk = _pick(kd, b, kv_idx)
                ok = ok & (_pick(qd, b, q_idx) == dk) & (dk >= 0)
            return ok

        cfg, sink = "_".join(f"w{w}r{r}" for w, r in self.configs), self.sink_tokens
        extra = ("_sliding" if self.sliding else "") + (f"_sink{sink}" if sink else "")
        extra += "".join(f"_dense{j}" for j in self.dense_kv_heads) + ("_causal" if causal else "")
        mask_mod.__name__ = f"dilated_{cfg}_{self.query_dilation}{extra}"
        return mask_mod

    # ------------------------------------------------------------------ counting
    def count_pairs(self, seq_len: int, num_heads: int, *, causal: bool = True,
                    q_len: Optional[int] = None, num_kv_heads: Optional[int] = None) -> list:
        """Exact number of allowed (query, key) pairs per query head, without materialising S².

        Keys are positions ``0..seq_len-1``; queries are the last ``q_len`` positions (default:
        all). A query head of a dense key/value head (``num_kv_heads`` needed then) counts every
        (causal) pair. How: :mod:`hf_hilbert_attn.counting`.
        """
        return counting.count_pairs(self, seq_len, num_heads, causal=causal, q_len=q_len,
                                    num_kv_heads=num_kv_heads)

    def count_pairs_total(self, seq_len: int, num_heads: int, **kw) -> int:
        """Sum of :meth:`count_pairs` over the query heads (same arguments)."""
        return int(sum(self.count_pairs(seq_len, num_heads, **kw)))

    def attention_flops(self, seq_len: int, num_heads: int, head_dim: int, *, causal=True,
                        backward: bool = False, batch: int = 1,
                        num_kv_heads: Optional[int] = None) -> float:
        """Useful FLOPs (allowed pairs only): 4·D per pair forward (QKᵀ and PV), 2.5× that for
        the backward (the FlashAttention-2 convention)."""
        pairs = self.count_pairs_total(seq_len, num_heads, causal=causal, num_kv_heads=num_kv_heads)
        return 4.0 * head_dim * pairs * batch * (2.5 if backward else 1.0)


def _warn_covered(w: tuple, r: tuple, sliding: bool) -> None:
    """Warn about a config that allows no pair another config does not (e.g. windows given in
    decreasing order, ``[32, 16]`` with rates ``[1, 2]``; the rule: ``planning.covers``):
    accepted, but it only costs time. Not while ``torch.compile`` traces a layer that rebuilds
    its pattern (the eager build has said it; a warning there would break the graph)."""
    if torch.compiler.is_compiling():
        return
    for i, j in itertools.permutations(range(len(w)), 2):
        same = (w[i], r[i]) == (w[j], r[j])
        if (same and i > j) or (not same and covers((w[j], r[j]), (w[i], r[i]), sliding)):
            warnings.warn(f"pattern config {i} (w={w[i]}, r={r[i]}) is covered by config {j} "
                          f"(w={w[j]}, r={r[j]}): it allows no pair the pattern would not allow "
                          f"without it; remove it", UserWarning, stacklevel=4)
            return


def _as_2d(t) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() not in (1, 2):
        raise ValueError(f"positions / document ids must be [S] or [B, S], got shape {tuple(t.shape)}")
    return t.unsqueeze(0) if t.dim() == 1 else t
