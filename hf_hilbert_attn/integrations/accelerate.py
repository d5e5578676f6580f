"""Sequence parallelism with Accelerate: the group, the batch shards, and the loss
(``docs/sequence_parallel.md``).

Topology: ``dp × sp`` ranks; each sequence-parallel (SP) group of ``sp`` ranks works on one
sequence. :func:`sequence_parallel_topology` takes the SP group from the Accelerator's device
mesh (``ParallelismConfig(cp_size=N)``, dim ``"cp"``; GPU only in Accelerate 1.15), else
consecutive ranks form the groups. Only the *mesh* is used: Accelerate's context parallelism
(``maybe_context_parallel``) patches SDPA and would shard the batch again; do not wrap our steps
in it.

Loss and gradients: each rank's loss is ``sum of its token losses / N`` (``N``: non-ignored
tokens of the whole sequence); :func:`reduce_loss` sums it over the SP group with an autograd
all-reduce whose backward sums too, and DDP's average over all ``dp · sp`` ranks then leaves the
gradient of single-process training (:func:`average_gradients` without DDP).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..ring.comm import split_group
from ..ring.ulysses import head_slice
from ..sharding import DEFAULT_LAYOUT, shard_batch

logger = logging.getLogger(__name__)

__all__ = ["SPTopology", "sequence_parallel_topology", "shard_for_sequence_parallel",
           "reduce_loss", "average_gradients"]


@dataclass(frozen=True)
class SPTopology:
    """Where this process sits in the ``dp × sp`` split: the SP ``group`` (None when
    ``sp_size == 1``), the rank in it and its size, the group's index among the groups and their
    number (which data each reads), and the ``source``: ``"mesh"`` (Accelerate's ``cp`` mesh
    dim), ``"split"`` or ``"single"``."""

    group: object
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    source: str


def sequence_parallel_topology(accelerator=None, sp_size: Optional[int] = None) -> SPTopology:
    """The SP group of this process.

    Args:
        accelerator: an ``accelerate.Accelerator`` (optional); with ``cp`` enabled in its
            ``parallelism_config`` and a device mesh, the mesh's ``"cp"`` dimension is the group.
        sp_size: ranks per sequence. Default: the mesh's ``cp`` size, else the world size.

    Returns an :class:`SPTopology`.

    Raises:
        ValueError: ``sp_size`` does not divide the world size, or disagrees with the mesh.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if sp_size not in (None, 1):
            raise ValueError(f"sp_size={sp_size} needs torch.distributed to be initialised "
                             "(launch with accelerate launch or torchrun)")
        return SPTopology(None, 0, 1, 0, 1, "single")
    world, rank = dist.get_world_size(), dist.get_rank()
    if getattr(getattr(accelerator, "parallelism_config", None), "cp_enabled", False):
        mesh = accelerator.torch_device_mesh
        if mesh is not None and "cp" in (mesh.mesh_dim_names or ()):
            cp = mesh["cp"]
            size = cp.size()
            if sp_size not in (None, size):
                raise ValueError(
                    f"sp_size={sp_size} disagrees with the Accelerator's cp_size={size}")
            group = cp.get_group()
            first = min(dist.get_process_group_ranks(group))
            firsts = [None] * world
            dist.all_gather_object(firsts, first)
            order = sorted(set(firsts))
            return SPTopology(group, cp.get_local_rank(), size, order.index(first), len(order),
                              "mesh")
    sp = world if sp_size is None else int(sp_size)
    if sp < 1 or world % sp:
        raise ValueError(f"sp_size must divide the world size {world}, got {sp_size}")
    # (the group held weakly: comm.split_group)
    group = None if sp == 1 else split_group(dist.group.WORLD, sp)[0]
    return SPTopology(group, rank % sp, sp, rank // sp, world // sp, "split")


def shard_for_sequence_parallel(batch: dict, topo: SPTopology, layout: str = DEFAULT_LAYOUT,
                                pattern=None, pad_to_multiple: int = 1, **kwargs) -> dict:
    """:func:`~hf_hilbert_attn.sharding.shard_batch` for this rank, plus
    ``num_items_in_batch`` = non-ignored labels of the whole sequence (so the model's loss is
    ``sum over this shard / N`` and :func:`reduce_loss` gives the mean over the sequence)."""
    group = topo.group if topo.group is not None else (0, 1)
    shard = shard_batch(batch, group, layout, pattern, pad_to_multiple, **kwargs)
    if "num_items" in shard:  # the sum of the non-ignored label counts over the SP group
        n = shard.pop("num_items").to(torch.int64)  # (0-dim, made by shard_batch: no gradient)
        if topo.group is not None:
            dist.all_reduce(n, group=topo.group)
        shard["num_items_in_batch"] = n.to(shard["input_ids"].device)
    return shard


def reduce_loss(loss: torch.Tensor, group) -> torch.Tensor:
    """Sum ``loss`` (this shard's ``sum of token losses / N``, ``N`` over the whole sequence)
    over the SP ``group`` (None: unchanged), differentiably (see the module docstring)."""
    return loss if group is None else _SumOverGroup.apply(loss, group)


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` whose backward also sums (every rank's loss depends on every
    rank's shard). Written here because ``torch.distributed.nn.functional.all_reduce``, which
    does the same, is deprecated in torch 2.13."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return _SumOverGroup.forward(ctx, grad, ctx.group), None


def average_gradients(model: torch.nn.Module, group=None) -> None:
    """Average ``.grad`` over ``group`` (default: world) — what DDP does, for runs without it."""
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


def deepspeed_head_slice(module, heads: int) -> Optional[tuple]:
    """Under DeepSpeed's Ulysses (Accelerate's ``ParallelismConfig(sp_size=N,
    sp_backend="deepspeed")``), a training layer is called with one rank's ``heads`` query heads
    over the whole sequence: their :func:`~hf_hilbert_attn.ring.ulysses.head_slice` (the first
    query head, the first key/value head, key/value heads), so per-head classes and dense heads
    stay those of one process. None elsewhere (DeepSpeed not imported or its groups not made,
    evaluation, every head given)."""
    mpu = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    # (its getter asserts the group exists, which torch.compile cannot trace: read the global)
    group = getattr(mpu, "_SEQUENCE_PARALLEL_GROUP", None) if module.training else None
    world, hq = group and dist.get_world_size(group), module.config.num_attention_heads
    hkv = getattr(module.config, "num_key_value_heads", None) or hq
    return head_slice(dist.get_rank(group), world, hq, hkv) if world and heads * world == hq \
        and heads < hq else None
