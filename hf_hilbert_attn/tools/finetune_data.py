"""The fine-tune's data (:mod:`.finetune`): documents from text or ``datasets`` files (or
generated), the byte tokenizer of the tiny default model, packing into ``[N, seq_len]`` blocks,
and the batch of each step -- a pure function of the step and the seed, which makes resume exact
-- including the retrieval steps of ``--retrieval-mix``."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .evaluation._args import InputError, InputNotFound


# ---------------------------------------------------------------------------------- data
def _byte_chars():
    """Byte value -> a printable character standing for it (the byte-level alphabet of GPT-2
    style tokenizers: printable Latin-1 bytes stand for themselves, the others are shifted
    above 255), so every byte is one token whose id is the byte value."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    shifted = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return chars


def ByteTokenizer():
    """UTF-8 bytes as tokens (id = byte value), EOS = 256: the tokenizer of the tiny default
    model, nothing to download. A ``PreTrainedTokenizerFast``, so ``final/`` keeps it and
    loads with ``AutoTokenizer`` (``hf-hilbert-attn eval OUTPUT_DIR/final`` works)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in _byte_chars().items()}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")])  # one token per byte
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   model_max_length=1 << 30)


def generated_corpus(n_docs: int = 400, seed: int = 0) -> list:
    """``n_docs`` short synthetic records (about 450 bytes each)."""
    rng = random.Random(seed)
    words = ("the cat dog bird sat ran flew on under over a mat log tree quickly slowly and then "
             "red blue green one two three four five").split()
    docs = []
    for i in range(n_docs):
        sent = [f"record {i}:"] + [rng.choice(words) for _ in range(rng.randint(20, 120))]
        docs.append(" ".join(sent) + f" (key {rng.randint(0, 999)}).")
    return docs


def load_texts(path, text_field, min_bytes: int = 0):
    """The documents, a list of strings.

    ``.txt``: each file is one document, read whole (``datasets``' text builder would make every
    line a document, and EOS between the lines of a play or a book is not what we train on).
    ``.jsonl``/``.json``/``.parquet``: one document per record of ``text_field``, read with
    ``datasets`` (the only kind that needs it).
    """
    if path is None:  # enough records for at least two blocks of the asked length
        return generated_corpus(max(400, 2 * min_bytes // 300 + 1))
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"--data not found: {path}")
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    kinds = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    by_kind = {}
    for f in files:
        if f.suffix in kinds:
            by_kind.setdefault(kinds[f.suffix], []).append(str(f))
    if len(by_kind) != 1:
        raise InputError(f"--data needs files of one kind among {sorted(kinds)}, got "
                         f"{[str(f) for f in files]}")
    kind, data_files = next(iter(by_kind.items()))
    if kind == "text":
        docs = [Path(f).read_text(encoding="utf-8") for f in data_files]
        docs = [d for d in docs if d.strip()]
        if not docs:
            raise InputError(f"--data {path}: every .txt file is empty")
        return docs
    import datasets

    ds = datasets.load_dataset(kind, data_files=data_files, split="train")
    if text_field not in ds.column_names:
        raise InputError(f"no column {text_field!r} in {data_files}: {ds.column_names} (choose "
                         f"one with --text-field)")
    return [t for t in ds[text_field] if isinstance(t, str)]


def pack(docs, tokenizer, seq_len: int) -> torch.Tensor:
    """Documents joined with EOS, cut into ``[N, seq_len]`` blocks (remainder dropped)."""
    ids = []
    for start in range(0, len(docs), 1000):
        for doc in tokenizer(docs[start:start + 1000])["input_ids"]:
            ids.extend(doc)
            ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise InputError(f"the corpus has {len(ids)} tokens, fewer than --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


class RetrievalMix:
    """The retrieval steps of ``--retrieval-mix``: which steps, and their ``[bs, S]`` rows.

    Row ``i`` of data-parallel rank ``d`` at the ``n``-th retrieval step is example
    ``(n·dp + d)·bs + i`` of :func:`~.evaluation.retrieval_train.retrieval_block`
    (a pure function of it), so resume stays exact.
    """

    def __init__(self, tokenizer, mix: float, tasks, seq_len: int, seed: int, documents=None):
        from .evaluation.retrieval_train import TRAIN_SEED, RetrievalSchedule
        from .evaluation.ruler import RulerGenerator

        self.schedule = RetrievalSchedule(mix, seed)
        self.generator = RulerGenerator(tokenizer, documents=documents, seed=TRAIN_SEED + seed)
        self.tasks, self.seq_len = tuple(tasks), seq_len

    def check(self) -> None:
        """Build one example of each task now: a ``--seq-len`` too short for one is an
        InputError before the model loads."""
        for i in range(len(self.tasks)):
            try:
                self.rows([i])
            except ValueError as e:
                raise InputError(f"--retrieval-tasks {self.tasks[i]} at --seq-len "
                                 f"{self.seq_len}: {e}") from None

    def rows(self, indices):
        """``(input_ids, labels)`` ``[len(indices), S]`` of examples ``indices``."""
        from .evaluation.retrieval_train import retrieval_block

        got = [retrieval_block(self.generator, i, self.seq_len, self.tasks)[:2] for i in indices]
        return torch.tensor([g[0] for g in got]), torch.tensor([g[1] for g in got])

    def batch(self, step: int, dp_rank: int, dp_size: int, bs: int):
        n = self.schedule.before(step)
        return self.rows([(n * dp_size + dp_rank) * bs + i for i in range(bs)])

    def blocks_in(self, steps: int, per_step: int) -> int:
        """Retrieval blocks (over every data-parallel rank) in steps ``0 .. steps-1``."""
        return self.schedule.before(steps) * per_step


def step_batch(blocks: torch.Tensor, step: int, dp_rank: int, dp_size: int, bs: int, seed: int,
               mix=None):
    """``(input_ids, labels, is_retrieval)`` of a step: text blocks (labels = the ids) from
    :func:`batch_for_step` at the step's place in the text order, or :class:`RetrievalMix`
    rows (labels only on the answers) at a retrieval step."""
    if mix is not None and mix.schedule.is_retrieval(step):
        ids, labels = mix.batch(step, dp_rank, dp_size, bs)
        return ids, labels, True
    text_step = mix.schedule.text_step(step) if mix is not None else step
    ids = batch_for_step(blocks, text_step, dp_rank, dp_size, bs, seed)
    return ids, ids, False


def batch_for_step(blocks: torch.Tensor, step: int, dp_rank: int, dp_size: int, bs: int,
                   seed: int) -> torch.Tensor:
    """The ``[bs, S]`` blocks of a data-parallel group at a step: a pure function of the step
    (epoch permutations seeded by ``seed + epoch``), which is what makes resume exact."""
    n = blocks.shape[0]
    per_step = bs * dp_size
    rows = []
    for i in range(bs):
        flat = step * per_step + dp_rank * bs + i
        epoch, j = divmod(flat, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        rows.append(int(perm[j]))
    return blocks[rows]
