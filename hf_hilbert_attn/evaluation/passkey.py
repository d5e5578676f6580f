"""Synthetic passkey retrieval: a number hidden at a chosen depth of filler text, read back with
``generate()``.

A prompt of (about) ``L`` tokens is::

    INTRO  filler … filler  NEEDLE("The pass key is 68302. Remember it. ")  filler …  QUESTION

with the needle's start at fraction ``depth`` of the filler. The model is asked to continue
"The pass key is"; the answer is correct iff the first run of digits it generates is the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

import torch

__all__ = [
    "PasskeyPrompt",
    "make_passkey_prompt",
    "score_passkey",
    "hf_generate_fn",
    "evaluate_passkey",
]

# Short fixed parts, so that even a character-level tokenizer fits them into 128 tokens.
INTRO = "A pass key is hidden in this text. Remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. "
QUESTION = "\nWhat is the pass key? The pass key is"

_DIGITS = re.compile(r"\d+")


@dataclass
class PasskeyPrompt:
    input_ids: torch.Tensor  # [1, L]
    key: str
    length: int
    depth: float
    needle_start: int  # token index of the needle in input_ids


def make_passkey_prompt(tokenizer, length: int, depth: float, key: str) -> PasskeyPrompt:
    """Build a prompt of exactly ``length`` tokens with the needle at fraction ``depth``.

    Args:
        tokenizer: any Hugging Face tokenizer.
        length: total prompt tokens; must leave room for the intro, needle and question.
        depth: 0.0 (needle right after the intro) … 1.0 (right before the question).
        key: the digits to hide.

    Raises:
        ValueError: ``depth`` outside [0, 1], or ``length`` too short for the fixed parts.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    enc = lambda text, special=False: tokenizer(text, add_special_tokens=special)["input_ids"]  # noqa: E731
    intro = enc(INTRO, special=True)  # BOS where the tokenizer adds one
    needle = enc(NEEDLE.format(key=key))
    question = enc(QUESTION)
    n_filler = length - len(intro) - len(needle) - len(question)
    if n_filler < 0:
        raise ValueError(
            f"passkey context length {length} is too short: intro, needle and question alone "
            f"take {length - n_filler} tokens with this tokenizer"
        )
    unit = enc(FILLER)
    filler = (unit * (n_filler // max(1, len(unit)) + 1))[:n_filler]
    cut = int(round(depth * n_filler))
    ids = intro + filler[:cut] + needle + filler[cut:] + question
    return PasskeyPrompt(torch.tensor([ids], dtype=torch.long), key, length, depth,
                         len(intro) + cut)


def score_passkey(answer: str, key: str) -> bool:
    """True iff the first run of digits in the generated ``answer`` equals ``key``."""
    m = _DIGITS.search(answer)
    return m is not None and m.group(0) == str(key)


def hf_generate_fn(model, tokenizer, max_new_tokens: int = 8) -> Callable[[torch.Tensor], str]:
    """A ``generate_fn`` for :func:`evaluate_passkey`: greedy ``model.generate`` on one prompt,
    returning only the newly generated text."""
    device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(input_ids: torch.Tensor) -> str:
        ids = input_ids.to(device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return generate


def evaluate_passkey(
    generate_fn: Callable[[torch.Tensor], str],
    tokenizer,
    length: int,
    depths: Sequence[float],
    trials: int,
    *,
    seed: int = 0,
    progress=None,
) -> List[Dict]:
    """Passkey accuracy at one context length for every depth.

    Args:
        generate_fn: maps a prompt ``[1, L]`` to the generated continuation text (a real model
            via :func:`hf_generate_fn`, or any function — tests pass fakes).
        tokenizer: builds the prompts.
        length: prompt length in tokens.
        depths: needle depths in [0, 1].
        trials: prompts per depth, each with its own random 5-digit key.
        seed: keys are a pure function of ``(seed, length, depth index, trial)``.
        progress: optional tqdm bar, advanced once per prompt.

    Returns:
        One dict per depth: ``length``, ``depth``, ``correct``, ``trials``, ``accuracy``,
        ``prompt_tokens`` (summed) and ``answers`` (the generated texts).
    """
    rows = []
    for di, depth in enumerate(depths):
        correct, answers, tokens = 0, [], 0
        for t in range(trials):
            key = str(random.Random(f"{seed}-{length}-{di}-{t}").randint(10000, 99999))
            prompt = make_passkey_prompt(tokenizer, length, depth, key)
            answer = generate_fn(prompt.input_ids)
            correct += score_passkey(answer, key)
            answers.append(answer)
            tokens += prompt.input_ids.shape[1]
            if progress is not None:
                progress.update(1)
        rows.append(dict(length=length, depth=float(depth), correct=correct, trials=trials,
                         accuracy=correct / trials if trials else float("nan"),
                         prompt_tokens=tokens, answers=answers))
    return rows
