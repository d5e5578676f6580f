"""Synthetic retrieval examples for fine-tuning (issue 26, item 5): RULER-style prompts of
:mod:`.ruler` as training blocks whose loss is on the answer only.

A block is exactly ``seq_len`` tokens, the answer at its end::

    [pad …]  prompt (BOS, intro, haystack with needles, question)  answer  EOS
    labels:  -100 everywhere except the answer tokens (unshifted, as Transformers takes them)

so the one thing the block teaches is to read the asked needle back from far away; the
haystack is not learned as text. The prompt is generated at ``seq_len - len(answer) - 1``
tokens (the answer's length is known once a prompt exists, so at most a few tries); the rare
block that still falls short (``common_words``, an answer whose tokens change with the
prompt) is padded on the left, with labels -100 there.

Two users:

* ``python -m hf_hilbert_attn.tools.finetune --retrieval-mix F``: :class:`RetrievalSchedule` makes a
  fraction ``F`` of the steps retrieval steps (every row of such a step is an example), spread
  evenly with a phase set by the seed; the text blocks keep their order (the same sequence of
  text blocks as without the mix, fewer of them).
* ``transformers.Trainer`` / ``SequenceParallelTrainer``: :func:`retrieval_examples` gives
  rows ``{"input_ids", "labels"}`` to concatenate with a dataset (docs/trainer.md).

Example ``r`` is a pure function of ``(seed, r)``: task ``tasks[r % len(tasks)]``, depth
uniform in [0, 1]. The prompts use their own seed (:data:`TRAIN_SEED` + the run's seed),
neither the evaluation's (0) nor calibration's (7919), so no evaluated prompt is trained on.
"""

from __future__ import annotations

import math
import random
from typing import Dict, List, Optional, Sequence, Tuple

from .ruler import ALL_TASKS, RulerGenerator

__all__ = ["TRAIN_TASKS", "TRAIN_SEED", "IGNORE_INDEX", "RetrievalSchedule", "retrieval_block",
           "retrieval_examples", "check_tasks"]

TRAIN_TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue")
TRAIN_SEED = 1_000_003  # + the run's seed; the evaluation uses 0, calibration 7919
IGNORE_INDEX = -100
_TRIES = 4  # prompt lengths tried before padding


def check_tasks(tasks: Sequence[str]) -> Tuple[str, ...]:
    """``tasks`` as a tuple; ValueError naming an unknown one and the known ones."""
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError(f"no retrieval task given; known: {', '.join(ALL_TASKS)}")
    bad = [t for t in tasks if t not in ALL_TASKS]
    if bad:
        raise ValueError(f"unknown retrieval task {bad[0]!r}; known: {', '.join(ALL_TASKS)}")
    return tasks


def retrieval_block(generator: RulerGenerator, index: int, seq_len: int,
                    tasks: Sequence[str] = TRAIN_TASKS) -> Tuple[List[int], List[int], str]:
    """Example ``index``: ``(input_ids, labels, task)``, both lists of exactly ``seq_len``.

    Raises:
        ValueError: ``seq_len`` too short for the task with this tokenizer.
    """
    tok = generator.tok
    task = tasks[index % len(tasks)]
    depth = random.Random(f"{generator.seed}-depth-{index}").random()
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    n_ans, best = 8, None  # a guess of the answer's length, corrected from each try
    for _ in range(_TRIES):
        s = generator.sample(task, seq_len - len(eos) - n_ans, depth, depth_index=index)
        total = len(s.input_ids) + len(s.answer_ids) + len(eos)
        if total <= seq_len and (best is None or total > best[0]):
            best = (total, s)
        if total == seq_len:
            break
        n_ans = len(s.answer_ids)
    if best is None:
        raise ValueError(f"could not fit a {task} prompt and its answer into {seq_len} tokens")
    s = best[1]
    ids = s.input_ids + s.answer_ids + eos
    pad = seq_len - len(ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos or [0])[0]
    labels = ([IGNORE_INDEX] * (pad + len(s.input_ids)) + list(s.answer_ids)
              + [IGNORE_INDEX] * len(eos))
    return [pad_id] * pad + ids, labels, task


def retrieval_examples(tokenizer, n: int, seq_len: int, tasks: Sequence[str] = TRAIN_TASKS,
                       seed: int = TRAIN_SEED, documents: Optional[Sequence[str]] = None
                       ) -> List[Dict[str, List[int]]]:
    """``n`` retrieval rows for ``transformers.Trainer``: ``{"input_ids", "labels"}``, lists of
    ``seq_len`` ints, the loss only on the answer (module docstring).

    Concatenate them with a tokenized dataset (``datasets.Dataset.from_list(rows)``, then
    ``concatenate_datasets`` and a shuffle) and keep a collator that keeps ``labels``
    (``default_data_collator``; ``DataCollatorForLanguageModeling`` would overwrite them).

    Args:
        tokenizer: the model's tokenizer.
        n: how many rows (examples ``0 .. n-1`` of ``seed``).
        seq_len: tokens per row.
        tasks: tasks of :mod:`.ruler`, cycled (default :data:`TRAIN_TASKS`).
        seed: the prompts' seed; keep it away from the evaluation's (0) and calibration's (7919).
        documents: real text for ``niah_single_text`` (default: the built-in corpus).

    Raises:
        ValueError: an unknown task, or ``seq_len`` too short for one.
    """
    tasks = check_tasks(tasks)
    gen = RulerGenerator(tokenizer, documents=documents, seed=seed)
    rows = []
    for r in range(n):
        ids, labels, _ = retrieval_block(gen, r, seq_len, tasks)
        rows.append({"input_ids": ids, "labels": labels})
    return rows


class RetrievalSchedule:
    """Which optimizer steps are retrieval steps: a fraction ``mix`` of them, evenly spread.

    Step ``s`` is one iff ``floor((s + 1)·mix + u) > floor(s·mix + u)``, ``u`` a uniform phase
    drawn from ``seed``; so the first ``s`` steps hold exactly ``floor(s·mix + u)`` retrieval
    steps (:meth:`before`), within one of ``s·mix`` whatever the run length, and a run is a pure
    function of the step (resume stays exact).
    """

    def __init__(self, mix: float, seed: int = 0):
        if not (isinstance(mix, (int, float)) and 0.0 <= mix < 1.0):
            raise ValueError(f"retrieval mix must be a fraction in [0, 1), got {mix}")
        self.mix = float(mix)
        self.phase = random.Random(f"retrieval-mix-{seed}").random() if mix else 0.0

    def before(self, step: int) -> int:
        """Retrieval steps among steps ``0 .. step-1``."""
        return int(math.floor(step * self.mix + self.phase)) if self.mix else 0

    def is_retrieval(self, step: int) -> bool:
        return self.before(step + 1) > self.before(step)

    def text_step(self, step: int) -> int:
        """The index of a text step in the order of text batches (steps without the mix)."""
        return step - self.before(step)
