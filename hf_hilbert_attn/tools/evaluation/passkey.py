"""Synthetic passkey retrieval: a number hidden at a chosen depth of filler text, read back with
``generate()``, or with one batched teacher-forced forward that reaches the same verdict.

A prompt of (about) ``L`` tokens is::

    INTRO  filler … filler  NEEDLE("The pass key is 68302. Remember it. ")  filler …  QUESTION

with the needle's start at fraction ``depth`` of the filler. The model is asked to continue
"The pass key is"; the answer is correct iff the first run of digits it generates is the key.
:func:`evaluate_passkey` generates (one prompt at a time, any ``generate_fn``);
:func:`passkey_teacher_forced` scores the same prompts with one ``[B, L + n]`` forward per batch
(see its docstring for why the two agree). With a ``hilbert_dilated`` model,
:func:`hf_generate_fn` generates through a :class:`~hf_hilbert_attn.PatternCache` (memory
bounded by the pattern) and prefills long prompts in chunks: a 1M-token prompt fits on one GPU.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hf_hilbert_attn.integrations.cache import prefill_chunks

from .perplexity import resolve_prefill_chunk

__all__ = [
    "PasskeyPrompt",
    "make_passkey_prompt",
    "score_passkey",
    "hf_generate_fn",
    "evaluate_passkey",
    "passkey_key",
    "passkey_prompts",
    "teacher_forced_answer",
    "passkey_teacher_forced",
    "evaluate_passkey_teacher_forced",
    "teacher_forced_predictions",
]

# Short fixed parts, so that even a character-level tokenizer fits them into 128 tokens.
INTRO = "A pass key is hidden in this text. Remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}."  # the continuation teacher forcing feeds (its digits; the "." ends the run)

_DIGITS = re.compile(r"\d+")


@dataclass
class PasskeyPrompt:
    input_ids: torch.Tensor  # [1, L]
    key: str
    length: int
    depth: float
    needle_start: int  # token index of the needle in input_ids


def check_prompt_fits(tokenizer, length: int, error=ValueError) -> None:
    """Raise ``error`` (one line) when the shortest passkey prompt cannot be built at
    ``length`` tokens: checked before any model runs."""
    try:
        make_passkey_prompt(tokenizer, length, 0.0, "12345")
    except ValueError as e:
        raise error(str(e)) from None


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


def passkey_key(seed: int, length: int, depth_index: int, trial: int) -> str:
    """The 5-digit key of one prompt: a pure function of its coordinates, so every method (and
    both scoring paths) sees the same keys."""
    return str(random.Random(f"{seed}-{length}-{depth_index}-{trial}").randint(10000, 99999))


def passkey_prompts(tokenizer, length: int, depths: Sequence[float], trials: int, *,
                    seed: int = 0) -> List[PasskeyPrompt]:
    """The prompts :func:`evaluate_passkey` uses at one length: depth-major, ``trials`` each."""
    return [make_passkey_prompt(tokenizer, length, depth, passkey_key(seed, length, di, t))
            for di, depth in enumerate(depths) for t in range(trials)]


def hf_generate_fn(model, tokenizer, max_new_tokens: int = 8, *,
                   prefill_chunk="auto") -> Callable[[torch.Tensor], str]:
    """A ``generate_fn`` for :func:`evaluate_passkey`: greedy ``model.generate`` on one prompt,
    returning only the newly generated text.

    ``prefill_chunk`` (see :func:`~.perplexity.resolve_prefill_chunk`):
    ``"auto"`` generates a ``hilbert_dilated`` model through a ``PatternCache`` (the same
    tokens as the full cache; memory bounded by the pattern), prefilling prompts longer than
    ``DEFAULT_PREFILL_CHUNK`` in chunks (``generate(prefill_chunk_size=...)``); other models
    keep ``generate``'s own cache. An int chunks every prompt longer than it; None: no
    chunking and no ``PatternCache``.
    """
    from hf_hilbert_attn.integrations.cache import PatternCache, cache_kwarg, uses_pattern_attention

    device = next(model.parameters()).device
    bounded = prefill_chunk is not None and uses_pattern_attention(model)

    @torch.inference_mode()
    def generate(input_ids: torch.Tensor) -> str:
        ids = input_ids.to(device)
        extra = {cache_kwarg(model): PatternCache(model)} if bounded else {}
        step = resolve_prefill_chunk(model, ids.shape[1], prefill_chunk)
        if step and step < ids.shape[1]:
            if not bounded:  # chunking needs a cache object to fill
                from transformers import DynamicCache

                extra = {cache_kwarg(model): DynamicCache(config=model.config)}
            extra["prefill_chunk_size"] = step
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
            **extra,
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
            key = passkey_key(seed, length, di, t)
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


# ----------------------------------------------------------------------------- teacher forcing
def teacher_forced_answer(tokenizer, key: str) -> Tuple[int, ...]:
    """The tokens a correct greedy answer starts with: after the prompt, up to and including the
    one holding the key's last digit.

    The prompt ends with ``tokenize(QUESTION)``. The answer tokens are those of
    ``tokenize(QUESTION + " 68302.")`` after that prefix — tokenised together, so a tokenizer
    that merges a space with the first digit (``" 6"``), splits digits singly, or merges them in
    groups (``"683", "02"``) gives the tokens it would give in running text. They are cut after
    the first token at which the decoded answer's first run of digits equals the key.

    Raises:
        ValueError: the tokenizer re-tokenises the end of the question when the answer follows
            (the prompt would then not be a prefix of prompt + answer), or no prefix of the answer
            tokens decodes to the key.
    """
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    question = enc(QUESTION)
    both = enc(QUESTION + ANSWER.format(key=key))
    if both[:len(question)] != question:
        raise ValueError(
            f"this tokenizer tokenises the end of the passkey question differently when the "
            f"answer follows ({question[-3:]} vs {both[len(question) - 3:len(question)]}), so "
            f"teacher forcing cannot score the prompt that generate() sees")
    rest = both[len(question):]
    for n in range(1, len(rest) + 1):
        text = tokenizer.decode(rest[:n], skip_special_tokens=True)
        m = _DIGITS.search(text)
        if m is not None and m.group(0) == key:
            return tuple(rest[:n])
    raise ValueError(f"no prefix of the answer tokens {rest} decodes to the key {key!r}")


@torch.inference_mode()
def passkey_teacher_forced(model, tokenizer, prompts: Sequence[PasskeyPrompt], *,
                           max_batch_tokens: int = 65536, progress=None,
                           prefill_chunk="auto") -> List[Dict]:
    """Score passkey prompts with one teacher-forced forward per batch instead of ``generate()``.

    Each prompt (all of the same length ``L``, as :func:`make_passkey_prompt` builds them) is
    followed by the answer tokens ``a_1..a_n`` of :func:`teacher_forced_answer` and the batch
    ``[B, L + n]`` runs once (right-padded where keys tokenise to different ``n``: a causal
    model's logits at a position never see later positions, so padding after the answer changes
    nothing before it). A prompt is correct iff

    1. at every answer position the argmax is the expected token: the prediction after
       ``prompt + a_1..a_{j-1}`` is ``a_j``, for ``j = 1..n``; and
    2. the argmax ``t`` after ``prompt + a_1..a_n`` does not continue the run of digits:
       the first run of digits of ``decode(a_1..a_n, t)`` is still the key.

    Why this is greedy ``generate()``: greedy decoding emits the argmax after the prompt, then
    the argmax after prompt + that token, and so on. By induction on ``j``, if the argmaxes of
    condition 1 hold, greedy decoding has fed exactly ``prompt + a_1..a_{j-1}`` when it picks its
    ``j``-th token, so its logits are the teacher-forced ones and it emits ``a_j``; at the first
    ``j`` where the argmax differs, greedy decoding emits that other token instead. So condition
    1 holds iff greedy generation starts with ``a_1..a_n``, and then its ``n+1``-th token is
    ``t``: with 2, the first run of digits of the generated text is exactly the key —
    :func:`score_passkey`'s rule. The two paths agree on every prompt, with three caveats:

    * a model that answers correctly but in another form (``"  68302"``, ``" is 68302"``, or a
      non-canonical split of the digits) passes ``generate()`` and fails here: teacher forcing is
      the stricter of the two, never the laxer;
    * ``generate()`` stopped by ``max_new_tokens`` right after the last digit counts as correct
      whatever would come next; here the next token is always checked;
    * a cached decode and a full forward round differently, so near-ties of the argmax can go
      either way (``tests/test_quality.py`` checks agreement on real and fake models).

    Args:
        model: a causal LM (``model(input_ids=..., logits_to_keep=..., use_cache=False)``).
        tokenizer: the one that built the prompts.
        prompts: :class:`PasskeyPrompt` s of one length.
        max_batch_tokens: at most this many tokens per forward (at least one prompt).
        progress: optional tqdm bar, advanced once per prompt.
        prefill_chunk: prompts longer than the resolved chunk (``"auto"``: 16K tokens for a
            ``hilbert_dilated`` model, see :func:`~.perplexity.resolve_prefill_chunk`) run one
            at a time as a chunked prefill through a ``PatternCache`` (same logits; memory
            bounded by the pattern and the chunk).

    Returns:
        One dict per prompt, in order: ``key``, ``depth``, ``length``, ``correct`` (bool),
        ``answer`` — the text greedy decoding emits up to and including its first token that
        differs from the expected answer (or the ``n + 1`` tokens when none does).

    Raises:
        ValueError: prompts of different lengths, or see :func:`teacher_forced_answer`.
    """
    if not prompts:
        return []
    L = prompts[0].input_ids.shape[1]
    if any(p.input_ids.shape[1] != L for p in prompts):
        raise ValueError(f"teacher-forced passkey prompts must share one length, got "
                         f"{sorted({p.input_ids.shape[1] for p in prompts})}")
    answers = [teacher_forced_answer(tokenizer, p.key) for p in prompts]
    preds = teacher_forced_predictions(
        model, [p.input_ids[0] for p in prompts], answers, pad_id=_pad_id(tokenizer),
        max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk, progress=progress)
    out = []
    for p, a, (got, _) in zip(prompts, answers, preds):
        n = len(a)
        miss = next((j for j in range(n) if got[j] != a[j]), None)
        if miss is None:
            text = tokenizer.decode(list(a) + got[n:n + 1], skip_special_tokens=True)
            correct = score_passkey(text, p.key)
            shown = got[:n + 1]
        else:
            correct, shown = False, got[:miss + 1]
        out.append(dict(key=p.key, depth=p.depth, length=L, correct=bool(correct),
                        answer=tokenizer.decode(shown, skip_special_tokens=True)))
    return out


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return pad if pad is not None else 0


@torch.inference_mode()
def teacher_forced_predictions(model, prompts: Sequence, answers: Sequence[Sequence[int]], *,
                               pad_id: int = 0, max_batch_tokens: int = 65536,
                               prefill_chunk="auto", log_probs: bool = False,
                               progress=None) -> List[Tuple[List[int], Optional[List[float]]]]:
    """The machinery of teacher-forced scoring: for each prompt ``p`` (token ids, any length)
    followed by its answer ``a_1..a_n``, the argmax tokens after ``p + a_1..a_j`` for
    ``j = 0..n`` (``n + 1`` tokens: the predictions of ``a_1..a_n`` and of the token after the
    answer) and, with ``log_probs``, ``log P(a_j | p + a_<j)`` for ``j = 1..n`` (float32).

    Prompts are sorted by length and batched, ``[B, T]`` with ``B * T <= max_batch_tokens``
    (at least one per forward), right-padded with ``pad_id``: a causal model's logits at a
    position never see later positions, so the padding changes nothing that is read. Only the
    logits from the shortest prompt's last position on are kept (``logits_to_keep``). Prompts
    longer than the resolved ``prefill_chunk`` (:func:`~.perplexity.resolve_prefill_chunk`) run
    one at a time as a chunked prefill (same logits; memory bounded by the pattern).

    Returns:
        One ``(argmax ids, log-probs or None)`` per prompt, in the order given.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    seqs = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not seqs:
        return []
    device = next(model.parameters()).device
    total = [len(s) + len(a) for s, a in zip(seqs, answers)]
    step = resolve_prefill_chunk(model, max(total), prefill_chunk)
    order = sorted(range(len(seqs)), key=lambda i: total[i])
    out: List = [None] * len(seqs)
    i = 0
    while i < len(order):  # a batch: consecutive prompts (by length) within max_batch_tokens
        j = i + 1
        while not step and j < len(order) and (j + 1 - i) * total[order[j]] <= max_batch_tokens:
            j += 1
        idx = order[i:j]
        T = max(total[k] for k in idx)
        lo = min(len(seqs[k]) for k in idx) - 1  # first position whose logits are read
        ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        for r, k in enumerate(idx):
            ids[r, :total[k]] = torch.cat([seqs[k], torch.as_tensor(list(answers[k]),
                                                                    dtype=torch.long)])
        if step:  # one prompt: chunks, each keeping the logits from position lo on
            logits = torch.cat([lg for _, _, lg in prefill_chunks(
                model, ids.to(device), chunk_tokens=step, logits_from=lo) if lg is not None], 1)
        else:
            try:
                logits = model(input_ids=ids.to(device), logits_to_keep=T - lo,
                               use_cache=False).logits
            except TypeError:  # a model without logits_to_keep
                logits = model(input_ids=ids.to(device), use_cache=False).logits
        logits = logits[:, -(T - lo):]  # [B, T - lo, V]: column c predicts position lo + c + 1
        pred = logits.argmax(-1).cpu()
        for r, k in enumerate(idx):
            c0, n = len(seqs[k]) - 1 - lo, len(answers[k])
            lp = None
            if log_probs and n:
                rows = torch.log_softmax(logits[r, c0:c0 + n].float(), -1)
                target = torch.as_tensor(list(answers[k]), device=rows.device)
                lp = rows.gather(-1, target[:, None])[:, 0].tolist()
            out[k] = (pred[r, c0:c0 + n + 1].tolist(), lp)
        if progress is not None:
            progress.update(len(idx))
        i = j
    return out


def evaluate_passkey_teacher_forced(model, tokenizer, length: int, depths: Sequence[float],
                                    trials: int, *, seed: int = 0, max_batch_tokens: int = 65536,
                                    progress=None, prefill_chunk="auto") -> List[Dict]:
    """:func:`evaluate_passkey`'s rows (same prompts and keys) scored by
    :func:`passkey_teacher_forced`: one dict per depth with ``length``, ``depth``, ``correct``,
    ``trials``, ``accuracy``, ``prompt_tokens`` and ``answers``."""
    prompts = passkey_prompts(tokenizer, length, depths, trials, seed=seed)
    res = passkey_teacher_forced(model, tokenizer, prompts, max_batch_tokens=max_batch_tokens,
                                 progress=progress, prefill_chunk=prefill_chunk)
    rows = []
    for di, depth in enumerate(depths):
        cell = res[di * trials:(di + 1) * trials]
        correct = sum(r["correct"] for r in cell)
        rows.append(dict(length=length, depth=float(depth), correct=correct, trials=trials,
                         accuracy=correct / trials if trials else float("nan"),
                         prompt_tokens=length * trials, answers=[r["answer"] for r in cell]))
    return rows
