"""RULER-style synthetic retrieval tasks, generated locally and scored by teacher forcing.

Tasks (after RULER, Hsieh et al. 2024), each prompt exactly ``length`` tokens of the model's
tokenizer (``common_words``: at most ``length``), the evidence at fraction ``depth`` of the
haystack, and every answer the continuation of an explicit cue, as in the passkey test::

    niah_single        noise haystack ("The grass is green..."), one needle:
                       "The special magic number for lobster is 68302."  ... cue
                       "The special magic number for lobster is" -> " 68302."
    niah_single_text   the same needle in real text (``documents``; the built-in corpus if none)
    niah_multikey      four needles with different keys; one is asked (the others distract)
    niah_multivalue    one key with four values; all are asked, in the order of the text
    niah_multiquery    four needles with different keys; two are asked, each after its own cue
    variable_tracking  a chain "VAR QKZTB = 40912." "VAR MLWXA = VAR QKZTB." ... and a
                       distractor chain; the variables holding the value are asked
                       ("... are: VAR QKZTB, VAR MLWXA, ...")
    common_words       a numbered word list where three words are frequent; the three most
                       frequent are asked, most frequent first, as a numbered list (no depth)
    passkey            the passkey prompt of :mod:`.passkey` (used by calibration)

Scoring (:func:`score_samples`): one teacher-forced forward per batch of prompts
(:func:`~.passkey.teacher_forced_predictions`). An answer lists items (a number, a variable, a
word). Item ``k`` is correct iff every token of it is the argmax at its position, given the
prompt and the expected answer before it, and the argmax after its last token does not extend
it (it is the expected next token or starts with neither a letter nor a digit). For a one-item
answer this is greedy decoding's verdict (the induction of
:func:`~.passkey.passkey_teacher_forced`); for several items it is greedy decoding's verdict on
item ``k`` once the items before it are given, so one early slip does not fail the rest. The
score of a prompt is RULER's metric: the fraction of expected items recalled.

Checked on SmolLM2-135M-Instruct, dense (CPU, float32, 2 prompts per task at 1K, 1 at 2K):
niah_single, niah_single_text, niah_multikey and niah_multiquery were always right;
niah_multivalue 0.25-0.75 (it misses the first digit of a value: which value comes next),
variable_tracking 0.25-0.5 (the first name right, the hops back mostly wrong), common_words
0.33 (a 135M model does not count). Read those three against dense, not against 1.

Word lists come from ``wonderwords`` (the ``ruler`` extra: ``pip install -e ".[ruler]"`` in a checkout; about 5,600 nouns)
or, without it, a built-in list of about 300 (the tests use it); :func:`word_list` says which.
Means, the per-prompt CSV and the heatmaps: :mod:`.ruler_report`.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import passkey as _pk
from .passkey import _pad_id, teacher_forced_predictions

__all__ = ["TASKS", "ALL_TASKS", "DEPTH_FREE", "RulerSample", "RulerGenerator", "word_list",
           "ruler_samples", "check_lengths", "score_samples", "evaluate_ruler"]

TASKS = ("niah_single", "niah_single_text", "niah_multikey", "niah_multivalue",
         "niah_multiquery", "variable_tracking", "common_words")
ALL_TASKS = TASKS + ("passkey",)
DEPTH_FREE = ("common_words",)  # no evidence position: depth is NaN

NOISE = _pk.FILLER
INTRO = "Some special magic numbers are hidden in the following text. Remember them.\n"
NEEDLE = "The special magic number for {key} is {value}. "
CUE = "The special magic number for {key} is"
QUESTION = "\nWhat is the special magic number for {key}? " + CUE
QUESTION_VALUES = ("\nWhat are all the special magic numbers for {key}? "
                   "The special magic numbers for {key} are")
QUESTION_QUERIES = "\nWhat are the special magic numbers for {keys}? " + CUE
VT_INTRO = "Memorize and track the chains of variable assignments hidden in the following text.\n"
VT_QUESTION = ("\nQuestion: Which variables are assigned the value {value}? Answer: The "
               "variables assigned the value {value} are:")
CWE_INTRO = "Below is a numbered list of words. Some words appear many times."
CWE_QUESTION = ("\nQuestion: What are the {k} most common words in the list above? Answer: The "
                "{k} most common words, from most to least frequent, are:")
NUM_NEEDLES = 4  # multikey / multivalue / multiquery
NUM_QUERIES = 2  # multiquery
VT_HOPS = 4  # variables per chain
CWE_COMMON = 3
CWE_SHARES = (0.12, 0.08, 0.05)  # fraction of the list each common word takes

# About 300 common concrete nouns: the list without wonderwords (tests, offline machines).
_FALLBACK_WORDS = sorted(set("""
apple anchor arrow badge bakery balloon bamboo banana banner barrel basket beach beacon bean
bell bench berry bicycle blanket boat bottle bowl bracelet branch bread brick bridge broom
bubble bucket butter button cabin cactus cake camera camel candle canoe canyon carpet carrot
castle cattle cave cellar chair chalk cherry chimney circle city cliff clock cloud coat coffee
coin comet compass cookie copper coral cotton cradle crane crayon crown crystal cup curtain
cushion daisy desert diamond dolphin donkey door dragon drum eagle engine envelope fabric
falcon feather fence ferry field flag flame flower flute forest fountain fox garden garlic
gate giraffe glacier glove goat granite grape guitar hammer harbor harp hat hawk helmet
honey horse hotel island ivory jacket jar jelly jungle kettle key kitten ladder lagoon lake
lamp lantern lemon letter lily lion lizard lobster locket magnet mango maple marble meadow
melon mirror monkey moon mountain mouse mushroom needle nest notebook ocean olive onion orange
orchard otter owl oyster paddle palace panda paper parrot peach peanut pearl pebble pencil
pepper piano pigeon pillow pilot pine pizza planet plate plum pocket pond potato pumpkin puppet
quilt rabbit radio raft rainbow raven ribbon river robot rocket rose ruby saddle sail salmon
sandal saucer scarf school scissors seal shell ship shovel silver sketch sled snail spider
spoon squirrel stable stamp statue stone stove straw stream sugar sunset swan sword table
tablet teapot temple tent thimble thunder tiger timber toast tomato torch tower tractor train
trumpet tulip tunnel turkey turtle umbrella valley vase velvet village violin volcano wagon
walnut walrus wand whale wheat wheel whistle willow window wizard wolf wool yacht zebra acorn
almond apron attic bagel ballad barn basil beetle biscuit blossom bonnet boulder bramble brass
canal cargo cedar cobalt cricket cypress ember fig flint galaxy geyser ginger goblet gravel
hazel heron jasmine kayak lark lichen lotus marsh mint moss nutmeg oasis opal orbit parcel
pasta pebble pepper plaza prism puddle quartz reef saffron sapphire shrub sparrow spruce
summit thistle tundra velvet violet vinegar walnut wren yarn
""".split()))

_ALNUM = set(string.ascii_letters + string.digits)
_WORDS_CACHE: Dict[str, Tuple[List[str], str]] = {}


def word_list(source: str = "auto") -> Tuple[List[str], str]:
    """``(words, source)``: lowercase nouns of 3-9 letters, sorted (so a seed picks the same
    words everywhere that source exists).

    ``source``: ``"auto"`` (wonderwords when installed, else the built-in list),
    ``"wonderwords"`` (raises ImportError without it) or ``"builtin"``.
    """
    if source not in ("auto", "wonderwords", "builtin"):
        raise ValueError(f"word source must be 'auto', 'wonderwords' or 'builtin', got {source!r}")
    if source in _WORDS_CACHE:
        return _WORDS_CACHE[source]
    got = None
    if source in ("auto", "wonderwords"):
        try:
            from wonderwords import RandomWord

            nouns = RandomWord().filter(include_categories=["noun"], word_min_length=3,
                                        word_max_length=9)
            got = sorted({w for w in nouns if re.fullmatch(r"[a-z]+", w)}), "wonderwords"
        except ImportError:
            if source == "wonderwords":
                raise ImportError("word source 'wonderwords' needs the package: "
                                  "pip install wonderwords (the ruler extra)") from None
    if got is None:
        got = list(_FALLBACK_WORDS), "builtin"
    _WORDS_CACHE[source] = got
    return got


# ----------------------------------------------------------------------------- samples
@dataclass
class RulerSample:
    """One prompt and its expected answer.

    ``input_ids``: the prompt (token ids). ``answer_ids``: the tokens teacher forcing feeds after
    it. ``item_spans``: per expected item, the ``[begin, end)`` range of ``answer_ids`` holding
    it. ``needle_spans``: ``[begin, end)`` ranges of ``input_ids`` holding the evidence of the
    answer (the asked needles; calibration reads them).
    """

    task: str
    length: int  # the requested length; len(input_ids) == length except for common_words
    depth: float  # NaN for DEPTH_FREE tasks
    index: int
    input_ids: List[int]
    answer_ids: List[int]
    items: List[str]
    item_spans: List[Tuple[int, int]]
    needle_spans: List[Tuple[int, int]] = field(default_factory=list)
    answer_text: str = ""


class RulerGenerator:
    """Builds :class:`RulerSample` s for one tokenizer; every sample is a pure function of
    ``(seed, task, length, depth index, trial)`` and the word list.

    Args:
        tokenizer: any Hugging Face tokenizer (a BOS is put first where it adds one).
        documents: real text for ``niah_single_text`` (joined by blank lines and cycled);
            None: the built-in generated corpus.
        words: the word list (default :func:`word_list`).
        seed: base seed.
    """

    def __init__(self, tokenizer, documents: Optional[Sequence[str]] = None,
                 words: Optional[Sequence[str]] = None, seed: int = 0):
        self.tok = tokenizer
        self.documents = list(documents) if documents else None
        self.words = list(words) if words else word_list()[0]
        if len(self.words) < 2 * NUM_NEEDLES + CWE_COMMON:
            raise ValueError(f"the word list needs at least {2 * NUM_NEEDLES + CWE_COMMON} "
                             f"words, got {len(self.words)}")
        self.seed = seed
        self._text: Optional[List[int]] = None
        self._cache: Dict[str, List[int]] = {}
        self._bos = self._enc_special("")

    # -- tokens
    def enc(self, text: str) -> List[int]:
        if text not in self._cache:
            self._cache[text] = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return self._cache[text]

    def _enc_special(self, text: str) -> List[int]:
        ids = list(self.tok(text, add_special_tokens=True)["input_ids"])
        plain = self.enc(text)
        return ids[:len(ids) - len(plain)] if ids[len(ids) - len(plain):] == plain else []

    def _text_tokens(self, n: int) -> List[int]:
        if self._text is None:
            from .corpus import builtin_corpus

            docs = self.documents or builtin_corpus(400_000)
            ids: List[int] = []
            for d in docs:
                ids += self.enc(d.strip() + "\n\n")
                if len(ids) > 40_000 and len(ids) > 2 * n:  # enough for most lengths
                    break
            self._text = ids
        return self._text

    def _rng(self, *coords) -> random.Random:
        return random.Random("-".join(str(c) for c in (self.seed,) + coords))

    # -- haystacks
    def _haystack(self, kind: str, n: int, rng: random.Random) -> List[int]:
        if kind == "noise":
            unit = self.enc(NOISE)
            return (unit * (n // len(unit) + 1))[:n]
        text = self._text_tokens(n)
        start = rng.randrange(len(text))
        start = self._boundary(kind, text, start)  # start at a sentence
        reps = (start + n) // len(text) + 1
        return (text * reps)[start:start + n] if reps > 1 else text[start:start + n]

    def _boundary(self, kind: str, hay: List[int], cut: int) -> int:
        """Move an insertion point back to the end of a sentence (at most 256 tokens)."""
        if kind == "noise":
            unit = len(self.enc(NOISE))
            return cut - cut % unit if cut < len(hay) else cut
        for c in range(cut, max(0, cut - 256) - 1, -1):
            if c == 0 or self.tok.decode(hay[c - 1:c]).rstrip(" ").endswith((".", "\n", "!", "?")):
                return c
        return cut

    def _assemble(self, kind: str, length: int, intro: List[int], pieces, question: List[int],
                  rng: random.Random):
        """``intro + haystack with pieces inserted + question``, exactly ``length`` tokens.

        ``pieces``: ``(depth, tokens, is_evidence)``; each goes in at fraction ``depth`` of the
        haystack (at a sentence end), in order of depth. Returns ``(ids, evidence spans)``.
        """
        n_fill = length - len(intro) - len(question) - sum(len(p[1]) for p in pieces)
        if n_fill < 0:
            raise ValueError(f"length {length} is too short for this task: its fixed parts take "
                             f"{length - n_fill} tokens with this tokenizer")
        hay = self._haystack(kind, n_fill, rng)
        ids, spans, prev = list(intro), [], 0
        for depth, toks, evidence in sorted(pieces, key=lambda p: p[0]):
            cut = max(prev, self._boundary(kind, hay, int(round(depth * n_fill))))
            ids += hay[prev:cut]
            if evidence:
                spans.append((len(ids), len(ids) + len(toks)))
            ids += toks
            prev = cut
        ids += hay[prev:] + question
        assert len(ids) == length
        return ids, spans

    def _answer(self, question: str, segments: Sequence[Tuple[str, bool]]):
        """Answer tokens and item spans for ``segments`` (text, is_item) after ``question``.

        Tokenised together with the question (as running text would be) when that leaves the
        question's tokens unchanged, else on its own. Item spans come from the decoded lengths
        of the answer's prefixes.
        """
        text = "".join(s for s, _ in segments)
        q = self.enc(question)
        both = self.enc(question + text)
        ans = both[len(q):] if both[:len(q)] == q else self.enc(text)
        full = self.tok.decode(ans, skip_special_tokens=True)
        ends = [len(self.tok.decode(ans[:t], skip_special_tokens=True))
                for t in range(1, len(ans) + 1)]
        items, spans, pos = [], [], 0
        for s, is_item in segments:
            if not is_item:
                continue
            at = full.find(s.strip(), pos)
            if at < 0:
                raise ValueError(f"answer item {s!r} not found in the decoded answer {full!r}: "
                                 f"the tokenizer must decode tokens back to their text")
            b, e = at, at + len(s.strip())
            t0 = next(t for t, end in enumerate(ends) if end > b)
            t1 = next(t for t, end in enumerate(ends) if end >= e) + 1
            items.append(s.strip())
            spans.append((t0, t1))
            pos = e
        return ans, items, spans, text

    def _key_words(self, rng: random.Random, k: int) -> List[str]:
        return rng.sample(self.words, k)

    @staticmethod
    def _number(rng: random.Random) -> str:
        return str(rng.randint(10000, 99999))

    @staticmethod
    def _var(rng: random.Random) -> str:
        return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))

    # -- tasks
    def sample(self, task: str, length: int, depth: float, depth_index: int = 0,
               trial: int = 0) -> RulerSample:
        """One prompt of ``task`` with ``length`` tokens and its evidence at ``depth``.

        Raises:
            ValueError: unknown task, depth outside [0, 1], or a length too short.
        """
        if task not in ALL_TASKS:
            raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(ALL_TASKS)}")
        if task in DEPTH_FREE:
            depth = float("nan")
        elif not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
        rng = self._rng(task, length, depth_index, trial)
        build = getattr(self, f"_{task}")
        ids, spans, question, segments = build(length, depth, rng, depth_index, trial)
        ans, items, item_spans, text = self._answer(question, segments)
        return RulerSample(task, length, depth, trial, ids, ans, items, item_spans, spans, text)

    def _niah(self, kind, length, depth, rng, *, keys=1, values=1, asked=1):
        """The NIAH family: ``keys`` needles (the first at ``depth``, the rest anywhere), the
        first key with ``values`` values; ``asked`` keys asked, each after its own cue."""
        # noise sentences end with a space; real text's cut points end with the full stop
        needle = NEEDLE if kind == "noise" else " " + NEEDLE.strip()
        names = self._key_words(rng, keys)
        vals = {k: [self._number(rng) for _ in range(values if i == 0 else 1)]
                for i, k in enumerate(names)}
        pieces, order = [], []
        for i, k in enumerate(names):
            for j, v in enumerate(vals[k]):
                d = depth if i == j == 0 else rng.random()
                pieces.append((d, self.enc(needle.format(key=k, value=v)), i < asked))
                order.append((d, k, v))
        asked_keys = names[:asked]
        if asked > 1:  # ask in a shuffled order, so the first asked is not always at `depth`
            rng.shuffle(asked_keys)
        if values > 1:
            question = QUESTION_VALUES.format(key=names[0])
            in_text = [v for d, k, v in sorted(order) if k == names[0]]
            segments = [(" " + in_text[0], True)]
            for v in in_text[1:]:
                segments += [(",", False), (" " + v, True)]
            segments.append((".", False))
        elif asked > 1:
            question = QUESTION_QUERIES.format(keys=" and ".join(asked_keys),
                                               key=asked_keys[0])
            segments = []
            for i, k in enumerate(asked_keys):
                if i:
                    segments.append((" " + CUE.format(key=k), False))
                segments += [(" " + vals[k][0], True), (".", False)]
        else:
            question = QUESTION.format(key=names[0])
            segments = [(" " + vals[names[0]][0], True), (".", False)]
        ids, spans = self._assemble(kind, length, self._bos + self.enc(INTRO), pieces,
                                    self.enc(question), rng)
        return ids, spans, question, segments

    def _niah_single(self, length, depth, rng, di, t):
        return self._niah("noise", length, depth, rng)

    def _niah_single_text(self, length, depth, rng, di, t):
        return self._niah("text", length, depth, rng)

    def _niah_multikey(self, length, depth, rng, di, t):
        return self._niah("noise", length, depth, rng, keys=NUM_NEEDLES)

    def _niah_multivalue(self, length, depth, rng, di, t):
        return self._niah("noise", length, depth, rng, values=NUM_NEEDLES)

    def _niah_multiquery(self, length, depth, rng, di, t):
        return self._niah("noise", length, depth, rng, keys=NUM_NEEDLES, asked=NUM_QUERIES)

    def _passkey(self, length, depth, rng, di, t):
        key = _pk.passkey_key(self.seed, length, di, t)
        p = _pk.make_passkey_prompt(self.tok, length, depth, key)
        n_needle = len(self.enc(_pk.NEEDLE.format(key=key)))
        return (p.input_ids[0].tolist(), [(p.needle_start, p.needle_start + n_needle)],
                _pk.QUESTION, [(" " + key, True), (".", False)])

    def _variable_tracking(self, length, depth, rng, di, t):
        names = set()
        while len(names) < 2 * VT_HOPS:
            names.add(self._var(rng))
        names = sorted(names)
        rng.shuffle(names)
        chains = [names[:VT_HOPS], names[VT_HOPS:]]
        value, other = self._number(rng), self._number(rng)
        pieces = []
        for c, (chain, val) in enumerate(zip(chains, (value, other))):
            # the asked chain starts at `depth` and continues after it; the distractor anywhere
            ds = sorted([depth + (1 - depth) * rng.random() for _ in chain[1:]]) if c == 0 \
                else sorted(rng.random() for _ in chain)
            ds = [depth] + ds if c == 0 else ds
            for i, (v, d) in enumerate(zip(chain, ds)):
                rhs = val if i == 0 else f"VAR {chain[i - 1]}"
                pieces.append((d, self.enc(f"VAR {v} = {rhs}. "), c == 0))
        question = VT_QUESTION.format(value=value)
        segments = []  # " VAR A, VAR B, ...": a small model names them as the text does
        for i, v in enumerate(chains[0]):
            segments += [("," if i else "", False), (" VAR", False), (" " + v, True)]
        segments.append((".", False))
        ids, spans = self._assemble("noise", length, self._bos + self.enc(VT_INTRO), pieces,
                                    self.enc(question), rng)
        return ids, spans, question, segments

    def _common_words(self, length, depth, rng, di, t):
        pool = list(self.words)
        rng.shuffle(pool)
        common, rare = pool[:CWE_COMMON], pool[CWE_COMMON:]
        question = CWE_QUESTION.format(k=CWE_COMMON)
        head, tail = self._bos + self.enc(CWE_INTRO), self.enc(question)
        budget = length - len(head) - len(tail)
        per_line = max(1, len(self.enc("\n100. " + rare[0])))
        n = max(CWE_COMMON * 8, budget // per_line + 8)  # a few too many; cut below
        counts = [max(1, int(round(s * n))) for s in CWE_SHARES]
        words = [w for w, c in zip(common, counts) for _ in range(c)]
        words += [rare[i % len(rare)] for i in range(n - len(words))]
        rng.shuffle(words)
        ids, kept = list(head), []
        for i, w in enumerate(words):
            line = self.enc(f"\n{i + 1}. {w}")
            if len(ids) + len(line) > length - len(tail):
                break
            ids += line
            kept.append(w)
        if not kept:
            raise ValueError(f"length {length} is too short for common_words")
        ranked = [w for w, _ in Counter(kept).most_common()]
        segments = []  # a numbered list, as the words were given
        for i, w in enumerate(ranked[:CWE_COMMON]):
            segments += [(f"\n{i + 1}.", False), (" " + w, True)]
        segments.append(("\n", False))
        return ids + tail, [], question, segments


def ruler_samples(generator: RulerGenerator, tasks: Sequence[str], lengths: Sequence[int],
                  depths: Sequence[float], trials: int) -> List[RulerSample]:
    """Every (task, length, depth, trial) sample, task-major; a DEPTH_FREE task gets
    ``trials × len(depths)`` trials instead (one cell per length, as many prompts)."""
    out = []
    for task in tasks:
        for L in lengths:
            if task in DEPTH_FREE:
                out += [generator.sample(task, L, float("nan"), 0, t)
                        for t in range(trials * len(depths))]
            else:
                out += [generator.sample(task, L, float(d), di, t)
                        for di, d in enumerate(depths) for t in range(trials)]
    return out


CHECKED_UP_TO = 4096  # check_lengths builds every prompt up to this length (a few hundred
# tokens of fixed parts fit in any longer one)


def _builds(generator: RulerGenerator, tasks, length: int, depths, trials) -> List[str]:
    """The tasks of ``tasks`` whose prompts cannot be built at ``length``."""
    bad = []
    for task in tasks:
        try:
            ruler_samples(generator, [task], [length], depths, trials)
        except ValueError:
            bad.append(task)
    return bad


def check_lengths(tokenizer, lengths: Sequence[int], *, tasks: Sequence[str] = TASKS,
                  depths: Sequence[float] = (0.5,), trials: int = 1, seed: int = 0,
                  documents: Optional[Sequence[str]] = None, error=ValueError,
                  what: str = "length") -> None:
    """Raise ``error`` (one line) when a prompt of ``tasks`` cannot be built at one of
    ``lengths`` with ``tokenizer``, naming the tasks and the shortest length that builds them
    all: checked before any model is built. Every prompt (depth, trial) of the lengths up to
    :data:`CHECKED_UP_TO` is built, and those of the shortest length whatever it is."""
    gen = RulerGenerator(tokenizer, documents=documents, seed=seed)
    todo = sorted(set(int(L) for L in lengths))
    for i, L in enumerate(todo):
        if i and L > CHECKED_UP_TO:
            break
        bad = _builds(gen, tasks, L, depths, trials)
        if not bad:
            continue
        lo, hi = L, 2 * L  # the shortest length that builds them: doubling, then bisection
        while _builds(gen, bad, hi, depths, trials):
            lo, hi = hi, 2 * hi
            if hi > 1 << 24:
                raise error(f"{what} {L}: no RULER prompt of {', '.join(bad)} can be built with "
                            f"this tokenizer")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _builds(gen, bad, mid, depths, trials) else (lo, mid)
        which = "every RULER task" if set(bad) == set(tasks) else "the RULER task(s) " + \
            ", ".join(bad)
        raise error(f"{what} {L} is too short for {which} with this tokenizer: the prompts need "
                    f"at least {hi} tokens (e.g. {1 << (hi - 1).bit_length()})")


# ----------------------------------------------------------------------------- scoring
def _extends(tokenizer, token: int) -> bool:
    text = tokenizer.decode([token], skip_special_tokens=True)
    return bool(text) and text[0] in _ALNUM


def score_samples(model, tokenizer, samples: Sequence[RulerSample], *,
                  max_batch_tokens: int = 65536, prefill_chunk="auto", progress=None,
                  log_probs: bool = False) -> List[Dict]:
    """Teacher-forced scores of ``samples`` (see the module docstring for the rule).

    Returns:
        One dict per sample: ``task``, ``length``, ``depth``, ``index``, ``score`` (fraction of
        items correct), ``correct`` / ``items`` (counts), ``expected`` and ``predicted`` (the
        items as the argmax tokens spell them, ``|``-joined), ``prompt_tokens`` and, with
        ``log_probs``, ``answer_logprob``: the summed log-probability of the items' tokens.
    """
    preds = teacher_forced_predictions(
        model, [s.input_ids for s in samples], [s.answer_ids for s in samples],
        pad_id=_pad_id(tokenizer), max_batch_tokens=max_batch_tokens,
        prefill_chunk=prefill_chunk, progress=progress, log_probs=log_probs)
    rows = []
    for s, (got, lp) in zip(samples, preds):
        ok, shown = [], []
        for b, e in s.item_spans:
            hit = got[b:e] == s.answer_ids[b:e]
            nxt = got[e]  # the prediction after the item's last token
            hit = hit and (e < len(s.answer_ids) and nxt == s.answer_ids[e]
                           or not _extends(tokenizer, nxt))
            ok.append(hit)
            shown.append(tokenizer.decode(got[b:e], skip_special_tokens=True).strip())
        row = dict(task=s.task, length=s.length, depth=s.depth, index=s.index,
                   score=sum(ok) / len(ok), correct=sum(ok), items=len(ok),
                   expected="|".join(s.items), predicted="|".join(shown),
                   prompt_tokens=len(s.input_ids))
        if log_probs:
            row["answer_logprob"] = float(sum(sum(lp[b:e]) for b, e in s.item_spans))
        rows.append(row)
    return rows


def evaluate_ruler(model, tokenizer, *, tasks: Sequence[str] = TASKS,
                   lengths: Sequence[int] = (2048, 4096, 8192),
                   depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0), trials: int = 2,
                   seed: int = 0, documents: Optional[Sequence[str]] = None,
                   words: Optional[Sequence[str]] = None, max_batch_tokens: int = 65536,
                   prefill_chunk="auto", progress=None) -> List[Dict]:
    """Generate and score the suite: :func:`ruler_samples` then :func:`score_samples`, one
    length at a time (prompts of one length batch together)."""
    gen = RulerGenerator(tokenizer, documents=documents, words=words, seed=seed)
    rows = []
    for L in lengths:
        samples = ruler_samples(gen, tasks, [L], depths, trials)
        rows += score_samples(model, tokenizer, samples, max_batch_tokens=max_batch_tokens,
                              prefill_chunk=prefill_chunk, progress=progress)
    return rows

