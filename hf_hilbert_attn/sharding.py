"""Sharding a batch over a sequence-parallel group, and gathering it back.

A layout decides which positions of a (padded) sequence of length ``S`` each of the ``W``
ranks holds, in which storage order; the attention always follows the true positions, so every
layout computes the same function — layouts differ only in per-rank work and communication.

* ``contiguous``: rank ``r`` holds positions ``[r·L, (r+1)·L)`` (``L = S / W``).
* ``zigzag``: ``2W`` chunks; rank ``r`` holds chunks ``r`` and ``2W-1-r``: under causal
  attention as many early (cheap) as late (expensive) queries on every rank.
* ``hilbert``: the positions in the pattern's Hilbert storage order (docs/hilbert.md; within each
  longest segment a Hilbert curve over the (row, dilation class) grid), cut into ``W``
  contiguous pieces: each rank holds a compact block of rows × classes.
* ``auto`` (the default): ``contiguous`` or ``zigzag``, by :func:`resolve_layout`.

Labels are shifted *before* sharding (``shift_labels[t] = labels[t + 1]``): the token that
predicts the next shard's first token keeps its label (Transformers' ``shift_labels``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .hilbert import hilbert_permutation
from .inputs import restart_documents
from .pattern import DilatedPattern

__all__ = ["LAYOUTS", "LAYOUT_CHOICES", "DEFAULT_LAYOUT", "resolve_layout", "padded_length",
           "shard_positions", "shard_batch", "gather_sequence", "shift_labels", "pairs_per_rank"]

LAYOUTS = ("contiguous", "zigzag", "hilbert")
LAYOUT_CHOICES = LAYOUTS + ("auto",)
DEFAULT_LAYOUT = "auto"
IGNORE_INDEX = -100


def _rank_world(group) -> Tuple[int, int]:
    if isinstance(group, (tuple, list)):
        if len(group) != 2:
            raise ValueError(f"group must be a process group or (rank, world_size), got {group!r}")
        rank, world = int(group[0]), int(group[1])
    else:
        if not dist.is_available() or not dist.is_initialized():
            if group is None:
                return 0, 1
            raise ValueError("a process group was given but torch.distributed is not initialised")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world_size), got rank {rank}, world_size {world}")
    return rank, world


def resolve_layout(layout: str, seq_len: int, world_size: int,
                   pattern: Optional[DilatedPattern] = None) -> str:
    """The concrete layout ``"auto"`` stands for (other layouts are returned unchanged).

    * Segment windows: ``contiguous`` if every shard is a whole number of
      ``pattern.max_segment`` tokens (no segment crosses a shard: the ring sends only the sink
      rows, and every rank does the same work), else ``zigzag`` (causal balance).
    * Sliding windows: ``contiguous`` if ``pattern.max_segment <= seq_len``: past the first
      window a query's work is the same everywhere, a shard needs keys from its neighbour only
      (measured: ``docs/decisions.md``). Longer windows are causal attention: ``zigzag``.
    * Dense key/value heads, no pattern, or ``seq_len <= 0``: ``zigzag`` (dense heads are causal
      attention over the whole sequence: measured, ``docs/decisions.md`` D46).
    """
    if layout != "auto":
        return layout
    if pattern is None or seq_len <= 0 or pattern.dense_kv_heads:
        return "zigzag"
    whole = pattern.max_segment <= seq_len if pattern.sliding else \
        seq_len % (world_size * pattern.max_segment) == 0
    return "contiguous" if whole else "zigzag"


def padded_length(seq_len: int, world_size: int, layout: str = "zigzag",
                  pad_to_multiple: int = 1) -> int:
    """Smallest length ``>= seq_len`` that ``layout`` splits evenly over ``world_size`` ranks, a
    multiple of ``pad_to_multiple`` per rank."""
    if seq_len < 0 or world_size < 1 or pad_to_multiple < 1:
        raise ValueError(f"need seq_len >= 0, world_size >= 1, pad_to_multiple >= 1; got "
                         f"{seq_len}, {world_size}, {pad_to_multiple}")
    if layout == "auto":
        raise ValueError("padded_length needs a concrete layout; call resolve_layout first")
    chunks = 2 * world_size if layout == "zigzag" else world_size
    unit = math.lcm(chunks, world_size * pad_to_multiple)
    return max(unit, -(-seq_len // unit) * unit)


def shard_positions(seq_len: int, world_size: int, layout: str = DEFAULT_LAYOUT,
                    pattern: Optional[DilatedPattern] = None, pad_to_multiple: int = 1,
                    device=None) -> torch.Tensor:
    """Positions held by each rank, in storage order.

    Args:
        seq_len: the unpadded sequence length.
        world_size: ranks in the group.
        layout: one of :data:`LAYOUT_CHOICES` (``"auto"``: :func:`resolve_layout`).
        pattern: needed for ``"hilbert"``.
        pad_to_multiple: each shard's length is a multiple of this.

    Returns:
        int64 ``[world_size, L]``: row ``r`` the positions rank ``r`` holds in the padded
        sequence of ``world_size · L`` (``>= seq_len``: padding).
    """
    layout = resolve_layout(layout, seq_len, world_size, pattern)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUT_CHOICES}, got {layout!r}")
    if layout == "hilbert" and not isinstance(pattern, DilatedPattern):
        raise ValueError("layout='hilbert' needs the DilatedPattern (pattern=...), got "
                         f"{type(pattern).__name__}")
    s = padded_length(seq_len, world_size, layout, pad_to_multiple)
    if layout == "contiguous":
        order = torch.arange(s)
    elif layout == "zigzag":
        c = torch.arange(s).view(2 * world_size, -1)
        order = torch.cat([torch.cat([c[r], c[2 * world_size - 1 - r]]) for r in range(world_size)])
    else:
        order = hilbert_permutation(s, pattern)[0]
    return order.view(world_size, -1).to(device)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``out[..., t] = labels[..., t + 1]``, last = ``ignore_index`` (what the token at ``t``
    must predict)."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def shard_batch(batch: dict, group=None, layout: str = DEFAULT_LAYOUT,
                pattern: Optional[DilatedPattern] = None, pad_to_multiple: int = 1, *,
                pad_token_id: int = 0, seq_dim: int = 1) -> dict:
    """This rank's shard of a causal-LM batch.

    Args:
        batch: ``input_ids`` ``[B, S]`` (required) and optionally ``labels`` ``[B, S]``
            (unshifted, as Transformers takes them), ``position_ids`` ``[B, S]`` or ``[S]``,
            ``attention_mask`` ``[B, S]``; other tensors with a sequence dim of size ``S`` at
            ``seq_dim`` are sharded the same way, everything else is passed through.
        group: the sequence-parallel process group, or ``(rank, world_size)`` (None: size 1).
        layout: one of :data:`LAYOUT_CHOICES` (``"auto"``: :func:`resolve_layout`); pattern: the
            model's (``"hilbert"`` and ``"auto"`` need it); pad_to_multiple: of each shard's
            length; pad_token_id: ``input_ids`` value of padding tokens.

    Returns:
        A new dict: ``input_ids`` ``[B, L]``; ``position_ids`` ``[B, L]`` (true positions;
        padding continues after the last one); ``hilbert_doc_ids`` (global document ids, -1 on
        padding) for packed documents or the ``"hilbert"`` layout; ``labels`` and
        ``shift_labels``, both the *already shifted* labels of this shard (-100 on padding), so
        ``model(**shard)`` does not shift again; ``attention_mask`` (0 on padding) when given;
        ``num_items``: the shard's non-ignored labels (0-dim tensor). ``ValueError``: unknown
        layout, missing ``input_ids``, inconsistent shapes.
    """
    if "input_ids" not in batch:
        raise ValueError(f"batch needs 'input_ids', got keys {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
    rank, world = _rank_world(group)
    s = ids.shape[1]
    pos_table = shard_positions(s, world, layout, pattern, pad_to_multiple)  # checks the layout
    sp = pos_table.numel()
    idx = pos_table[rank].to(ids.device)  # [L] indices into the padded sequence

    def take(x, value, dim=1):  # this rank's shard of x (length s at dim) padded with value
        if x.shape[dim] != s:
            raise ValueError(f"every sequence tensor must have length {s} at dim {dim}, got "
                             f"shape {tuple(x.shape)}")
        if sp != s:  # padded to the sharded length sp (at the end of dim)
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, sp - s), value=value)
        return x.index_select(dim, idx.to(x.device))

    out = {"input_ids": take(ids, pad_token_id)}
    pos = batch.get("position_ids")  # true positions; padding continues after the last one
    if pos is None:
        full_pos = torch.arange(sp, device=ids.device).expand(ids.shape[0], sp)
    else:
        pos = pos.expand(ids.shape) if pos.dim() == 1 else pos
        full_pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(sp - s, device=pos.device)], 1)
    out["position_ids"] = full_pos.index_select(1, idx)
    docs = None if pos is None else restart_documents(pos)
    if docs is not None or layout == "hilbert":
        # a shard cannot see where packed documents start, nor tell Hilbert order from
        # restarts: global document ids (padding -1, never attended)
        docs = torch.zeros_like(ids, dtype=torch.int64) if docs is None else docs
        out["hilbert_doc_ids"] = take(docs, -1)
    if (labels := batch.get("labels")) is not None:
        sh = out["labels"] = out["shift_labels"] = take(shift_labels(labels), IGNORE_INDEX)
        out["num_items"] = (sh != IGNORE_INDEX).sum()
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = take(batch["attention_mask"], 0)
    for key, val in batch.items():
        if key in out or key in ("labels", "position_ids", "attention_mask"):
            continue
        seq = isinstance(val, torch.Tensor) and val.dim() > seq_dim and val.shape[seq_dim] == s
        out[key] = take(val, 0, seq_dim) if seq else val
    return out


def gather_sequence(x: torch.Tensor, group=None, layout: str = DEFAULT_LAYOUT, *,
                    seq_len: Optional[int] = None, pattern: Optional[DilatedPattern] = None,
                    dim: int = 1, pad_to_multiple: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_batch` for one tensor: all ranks get the whole sequence.

    Args:
        x: this rank's shard, sequence along ``dim`` (all ranks the same shape).
        group: the process group (or None: returned as is).
        layout, pattern, pad_to_multiple: as given to :func:`shard_batch`.
        seq_len: the unpadded length to trim to (default: keep the padding).
        dim: the sequence dim.

    Returns:
        The tensor in natural position order along ``dim``; differentiable (each rank's slice
        gets its gradient back).
    """
    if group is None or not dist.is_initialized() or (world := dist.get_world_size(group)) == 1:
        return x if seq_len is None else x.narrow(dim, 0, seq_len)
    if x.requires_grad:
        from torch.distributed.nn.functional import all_gather

        parts = list(all_gather(x.contiguous(), group=group))
    else:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
    stored = torch.cat(parts, dim=dim)  # positions pos_table.flatten() along dim
    full_len = stored.shape[dim]
    if layout == "auto":
        if seq_len is None:
            raise ValueError("gather_sequence(layout='auto') needs seq_len (the unpadded length "
                             "given to shard_batch) to know which layout was used")
        layout = resolve_layout(layout, seq_len, world, pattern)
    pos_table = shard_positions(full_len, world, layout, pattern)
    if pos_table.numel() != full_len:
        raise ValueError(f"a gathered length of {full_len} cannot come from layout {layout!r} over "
                         f"{world} ranks")
    inv = torch.argsort(pos_table.flatten())  # the inverse permutation: position -> stored index
    out = stored.index_select(dim, inv.to(x.device))
    return out if seq_len is None else out.narrow(dim, 0, seq_len)


def pairs_per_rank(pattern: DilatedPattern, seq_len: int, world_size: int,
                   layout: str = DEFAULT_LAYOUT, num_heads: int = 1) -> list:
    """Exact allowed (query, key) pairs (causal, summed over heads) per rank for a layout: per
    run ``[a, b)`` of consecutive query positions, ``pattern.count_pairs(b, q_len=b - a)`` (no
    S² work); padding excluded.
    """
    table = shard_positions(seq_len, world_size, layout, pattern)  # resolves "auto"
    out = []
    for r in range(world_size):
        p = torch.sort(table[r][table[r] < seq_len]).values
        breaks = (torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1).tolist()
        runs = zip([0] + breaks, breaks + [p.numel()]) if p.numel() else ()  # (no query: 0)
        # the sparse heads only: dense heads cost what causal attention costs, which the
        # balanced layouts already even out
        out.append(sum(pattern.sparse_part.count_pairs_total(
            int(p[b - 1]) + 1, num_heads, q_len=int(p[b - 1]) + 1 - int(p[a]))
            for a, b in runs))
    return out
