"""Sequence parallelism for ``transformers.Trainer`` (and TRL's ``SFTTrainer``); guide:
``docs/trainer.md``.

Trainer's own context parallelism (``ParallelismConfig(cp_size=N)``) patches SDPA only and
refuses any other attention. Here, built from :mod:`hf_hilbert_attn.integrations.accelerate`:

* **Topology**: ``dp × sp`` ranks, consecutive ranks one sequence-parallel group.
* **Data**: DataLoaders split over the ``dp`` groups (``prepare_data_loader`` with
  ``num_processes=dp``): a group's ranks read the same batch (checked each step, 24 bytes).
* **Sharding**: :class:`SequenceParallelCollator` (``sharding.shard_batch``, labels shifted).
* **Step**: ``training_step`` / ``prediction_step`` inside ``sequence_parallel``: the ring.
* **Loss**: Trainer's token accounting (``num_items_in_batch`` over all ranks) and DDP's
  gradient average give the 1-process gradient and loss; no extra all-reduce.

``SequenceParallelTrainer(..., sp_size=2)`` is the Trainer (``sp_size == 1``: the plain one);
``sequence_parallel_trainer(SFTTrainer)`` makes the same class over another Trainer subclass.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from transformers import Trainer, default_data_collator

from .. import DilatedPattern, sequence_parallel, shard_batch
from ..ring.comm import MODES, all_gather
from ..sharding import DEFAULT_LAYOUT, IGNORE_INDEX, LAYOUT_CHOICES
from .model_config import ATTN_IMPLEMENTATION as ATTN, sharding_pattern
from .accelerate import SPTopology, sequence_parallel_topology

logger = logging.getLogger(__name__)

__all__ = ["SequenceParallelCollator", "SequenceParallelMixin", "SequenceParallelTrainer",
           "sequence_parallel_trainer", "FINGERPRINT_KEY"]

FINGERPRINT_KEY = "hilbert_sp_fingerprint"
# Flash/varlen keys of the *unsharded* packed layout (wrong for a shard, whose documents come as
# hilbert_doc_ids): DataCollatorWithFlattening(return_flash_attn_kwargs=True), TRL's collator.
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _fingerprint(batch: dict) -> torch.Tensor:
    """int64 ``[3]``: shape and a position-weighted checksum of the whole (unsharded) batch."""
    ids = batch["input_ids"].to(torch.int64)
    w = torch.arange(1, ids.numel() + 1, dtype=torch.int64).view(ids.shape) * 1000003 + 7
    h = (ids * w).sum()
    if batch.get("labels") is not None:
        h = h + (batch["labels"].to(torch.int64) * (w + 11)).sum()
    return torch.stack([torch.tensor(ids.shape[0]), torch.tensor(ids.shape[1]), h])


class SequenceParallelCollator:
    """Collate with ``collator``, then keep this rank's shard of every sequence.

    ``collator``: the one to wrap (``DataCollatorWithFlattening``, TRL's, ...; None:
    ``default_data_collator``); its output needs ``input_ids`` ``[B, S]``, and ``labels`` (or
    ``shift_labels``), ``position_ids``, ``attention_mask`` are used when present. ``sp_rank``,
    ``sp_size``: this rank's place in its group; ``layout``: of ``LAYOUT_CHOICES``; ``pattern``:
    the model's (``model_config.sharding_pattern``: ``"auto"`` and ``"hilbert"`` use it);
    ``pad_token_id``: the ``input_ids`` value of the padding :func:`shard_batch` adds.

    Returns (per call) :func:`~hf_hilbert_attn.sharding.shard_batch`'s dict without
    ``num_items`` (Trainer counts ``shift_labels``) and the unsharded varlen keys, plus
    :data:`FINGERPRINT_KEY` (checked and removed by the trainer). Picklable (DataLoader workers).
    """

    def __init__(self, collator, sp_rank: int, sp_size: int, layout: str = DEFAULT_LAYOUT,
                 pattern: Optional[DilatedPattern] = None, pad_token_id: int = 0):
        if layout not in LAYOUT_CHOICES:
            raise ValueError(f"sp_layout must be one of {LAYOUT_CHOICES}, got {layout!r}")
        if not 0 <= sp_rank < sp_size:
            raise ValueError(f"need 0 <= sp_rank < sp_size, got sp_rank={sp_rank}, sp_size={sp_size}")
        self.collator, self.sp_rank, self.sp_size = collator, int(sp_rank), int(sp_size)
        self.layout, self.pattern, self.pad_token_id = layout, pattern, int(pad_token_id)

    def __call__(self, features):
        collate = default_data_collator if self.collator is None else self.collator
        batch = {k: v for k, v in dict(collate(features)).items() if k not in _VARLEN_KEYS}
        if "input_ids" not in batch:
            raise ValueError(f"sequence parallelism needs 'input_ids' in every batch; the collator "
                             f"returned {sorted(batch)}")
        if batch["input_ids"].dim() == 1:  # a flattened row without its batch dim
            batch = {k: v.unsqueeze(0) if isinstance(v, torch.Tensor) and v.dim() == 1 else v
                     for k, v in batch.items()}
        if (pre := batch.pop("shift_labels", None)) is not None:
            # shard_batch shifts `labels` itself: give it the labels whose shift is `pre`. The
            # last token of a row has no next token, so a collator leaves its label ignored.
            if bool((pre[..., -1] != IGNORE_INDEX).any()):
                raise ValueError("shift_labels[..., -1] must be -100 (the last token of a row "
                                 f"predicts nothing), got {pre[..., -1].tolist()}")
            batch["labels"] = torch.nn.functional.pad(pre[..., :-1], (1, 0), value=IGNORE_INDEX)
        shard = shard_batch(batch, (self.sp_rank, self.sp_size), self.layout, self.pattern,
                            pad_token_id=self.pad_token_id)
        shard.pop("num_items", None)
        shard[FINGERPRINT_KEY] = _fingerprint(batch)
        return shard


class SequenceParallelMixin:
    """Sequence parallelism for a ``transformers.Trainer`` subclass (put it first in the bases).

    Extra keyword arguments:
        sp_size: ranks per sequence (default: every process; 1 turns the mixin off). The rest of
            the world is data parallel: ``world = dp × sp_size``. In one process (no process
            group, or a world of 1) any ``sp_size`` gives the plain Trainer, with a warning.
        sp_layout: how a sequence is cut over the group (default ``"auto"``, see
            :func:`hf_hilbert_attn.sharding.resolve_layout`).
        sp_mode: ``"ring"``, ``"ulysses"`` (head-sharded) or ``"auto"`` (the default), as in
            :func:`hf_hilbert_attn.sequence_parallel`.

    Raises (one-line ``ValueError``, the same on every rank): ``sp_size`` does not divide the
        world size; attention other than ``hilbert_dilated``; Trainer's own context parallelism;
        ``average_tokens_across_devices=False``, ``label_smoothing_factor > 0``,
        ``compute_loss_func``, or a forward without ``num_items_in_batch``.
    """

    def __init__(self, *args, sp_size: Optional[int] = None, sp_layout: str = DEFAULT_LAYOUT,
                 sp_mode: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        if sp_layout not in LAYOUT_CHOICES:
            raise ValueError(f"sp_layout must be one of {LAYOUT_CHOICES}, got {sp_layout!r}")
        if sp_mode not in MODES:
            raise ValueError(f"sp_mode must be one of {MODES}, got {sp_mode!r}")
        if sp_size is not None and (not isinstance(sp_size, int) or sp_size < 1):
            raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            raise ValueError(
                "SequenceParallelTrainer shards sequences itself: remove cp_size/sp_size from "
                "parallelism_config (Trainer's context parallelism patches SDPA only) and pass "
                "sp_size= to the trainer")
        if sp_size not in (None, 1) and not (dist.is_available() and dist.is_initialized()
                                               and dist.get_world_size() > 1):
            # a script written for `torchrun --nproc_per_node N` run as one process: the plain
            # Trainer (documented), said once rather than refused
            logger.warning("sp_size=%s with one process: training as the plain Trainer (launch %s "
                           "processes with torchrun or accelerate launch for sequence "
                           "parallelism)", sp_size, sp_size)
            sp_size = None
        topo = sequence_parallel_topology(None, sp_size)
        self.sp_topology: SPTopology = topo
        self.sp_layout, self.sp_mode = sp_layout, sp_mode
        if topo.sp_size == 1:
            return
        sp, model = topo.sp_size, self.accelerator.unwrap_model(self.model)
        if (impl := getattr(getattr(model, "config", None), "_attn_implementation", None)) != ATTN:
            raise ValueError(f"sp_size={sp} needs a model loaded with attn_implementation="
                             f"{ATTN!r}, got {impl!r}")
        a = self.args
        if not a.average_tokens_across_devices:
            raise ValueError(f"sp_size={sp} needs average_tokens_across_devices=True (the loss is "
                             "the token mean over all ranks)")
        if a.label_smoothing_factor:
            raise ValueError(f"sp_size={sp} does not support label_smoothing_factor="
                             f"{a.label_smoothing_factor} (labels are shifted before sharding)")
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError(f"sp_size={sp} does not support compute_loss_func (labels are "
                             "shifted before sharding; the model's own loss takes shift_labels)")
        if not getattr(self, "model_accepts_loss_kwargs", True):
            raise ValueError(f"sp_size={sp} needs a model whose forward accepts "
                             f"num_items_in_batch (loss kwargs), got {type(model).__name__}")
        pattern = sharding_pattern(model.config)
        pad = getattr(getattr(self, "processing_class", None), "pad_token_id", None) or 0
        self.data_collator = SequenceParallelCollator(
            self.data_collator, topo.sp_rank, topo.sp_size, sp_layout, pattern, pad_token_id=pad)
        logger.info("sequence parallel: world %d = dp %d x sp %d, layout %s, %s",
                    topo.dp_size * topo.sp_size, topo.dp_size, topo.sp_size, sp_layout, pattern)

    @property
    def sp_active(self) -> bool:
        return getattr(self, "sp_topology", None) is not None and self.sp_topology.sp_size > 1

    def _sp_step(self, inputs: dict):
        """Every rank of a group must hold a shard of the same batch; raise on all of them if not.
        Returns the step's context: ``sequence_parallel`` over the group (none while inactive)."""
        if not self.sp_active:
            return contextlib.nullcontext()
        if (fp := inputs.pop(FINGERPRINT_KEY, None)) is None:
            raise ValueError("the batch was not sharded by SequenceParallelCollator (was "
                             "trainer.data_collator replaced after the trainer was built?)")
        parts = all_gather(fp, self.sp_topology.group)
        if any(not torch.equal(p, parts[0]) for p in parts):
            raise ValueError(
                "the ranks of a sequence-parallel group got different batches (shape, checksum "
                f"per rank: {[p.tolist() for p in parts]}); keep the DataLoader deterministic "
                "(accelerator_config use_seedable_sampler=True, the default)")
        return sequence_parallel(self.sp_topology.group, self.sp_mode)

    # ------------------------------------------------------------------ data
    def _prepare_dataloader_per_group(self, dataloader, device_placement=None):
        """``Accelerator.prepare_data_loader`` over the ``dp`` groups instead of every rank."""
        acc, topo = self.accelerator, self.sp_topology
        if getattr(dataloader, "_is_accelerate_prepared", False):
            return dataloader
        prepared = prepare_data_loader(
            dataloader, acc.device, num_processes=topo.dp_size, process_index=topo.dp_rank,
            split_batches=acc.split_batches,
            put_on_device=acc.device_placement if device_placement is None else device_placement,
            rng_types=list(acc.rng_types), dispatch_batches=False, even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader)
        acc._dataloaders.append(prepared)
        return prepared

    def _per_group_dataloader(self, get, *args):
        """``get(*args)``, one of Trainer's DataLoader getters, split over the ``dp`` groups."""
        if not self.sp_active:
            return get(*args)
        acc = self.accelerator
        # Trainer's DataLoaders go through accelerator.prepare -> prepare_data_loader: shadow it
        acc.prepare_data_loader = self._prepare_dataloader_per_group
        try:
            return get(*args)
        finally:
            del acc.prepare_data_loader

    def get_train_dataloader(self):
        return self._per_group_dataloader(super().get_train_dataloader)

    def get_eval_dataloader(self, eval_dataset=None):
        return self._per_group_dataloader(super().get_eval_dataloader, eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self._per_group_dataloader(super().get_test_dataloader, test_dataset)

    def get_total_train_batch_size(self, args) -> int:
        return super().get_total_train_batch_size(args) if not self.sp_active else \
            self._train_batch_size * args.gradient_accumulation_steps * self.sp_topology.dp_size

    # ------------------------------------------------------------------ steps
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self._sp_step(inputs):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.sp_active and not prediction_loss_only:
            raise ValueError("under sequence parallelism evaluation gives the loss only (each rank "
                             "holds a shard of the logits): drop compute_metrics or set "
                             "prediction_loss_only=True")
        with self._sp_step(inputs):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """``transformers.Trainer`` with sequence parallelism (:class:`SequenceParallelMixin`):
    ``SequenceParallelTrainer(model=..., args=..., train_dataset=..., sp_size=2)``."""


_CLASSES = {Trainer: SequenceParallelTrainer}


def sequence_parallel_trainer(base):
    """``base`` (a ``transformers.Trainer`` subclass such as TRL's ``SFTTrainer``) with
    :class:`SequenceParallelMixin` in front; the same class object for the same ``base``."""
    if not (isinstance(base, type) and issubclass(base, Trainer)):
        raise TypeError(f"sequence_parallel_trainer needs a transformers.Trainer subclass, got {base!r}")
    if issubclass(base, SequenceParallelMixin):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"SequenceParallel{base.__name__}", (SequenceParallelMixin, base),
                              {"__module__": __name__, "__doc__": SequenceParallelMixin.__doc__})
    return _CLASSES[base]
