"""Text, tokenizer and model for the long-context eval: local files or built-in stand-ins.

Nothing here downloads anything. The built-in default is a character-level tokenizer over
printable ASCII and a tiny random-initialised Llama, so the whole eval runs on a fresh CPU
machine; its numbers test the pipeline (and sdpa vs hilbert_dilated agreement), not a language
model's quality.
"""

from __future__ import annotations

import logging
import random
import string
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "builtin_corpus",
    "corpus_files",
    "load_corpus",
    "build_char_tokenizer",
    "build_default_model",
    "DEFAULT_MODEL_CONFIG",
]

# hidden 64, 2 layers, GQA 4/2: about 60K parameters; a 2K-token forward is milliseconds on CPU.
DEFAULT_MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1 << 20,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

_WORDS = (
    "river stone light garden window paper market silver thunder quiet orange forest engine "
    "harbor winter summer letter bridge candle mirror violet planet signal valley shadow "
    "copper meadow lantern island morning evening station captain teacher painter farmer "
    "walks sees finds carries builds opens keeps follows remembers watches answers writes "
    "old new small bright heavy gentle distant hidden early late green blue red golden"
).split()

_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def builtin_corpus(num_chars: int = 200_000, seed: int = 0) -> List[str]:
    """A generated corpus of "documents" with long-range repetition.

    Each document is made of sentences drawn from a small grammar; about a quarter of the
    sentences repeat one written earlier in the same document, so a model that uses a long
    context can predict them. A smoke-test text: a trained model's perplexity need not fall with
    context on it (SmolLM2-135M: 314.6 at 2K, 353 at 4K).

    Args:
        num_chars: approximate total size in characters.
        seed: the generator's seed (the corpus is a pure function of it).

    Returns:
        A list of document strings.
    """
    rng = random.Random(seed)
    docs, total = [], 0
    while total < num_chars:
        sentences: List[str] = []
        for _ in range(rng.randint(40, 120)):
            if sentences and rng.random() < 0.25:
                sentences.append(rng.choice(sentences))
            else:
                w = [rng.choice(_WORDS) for _ in range(rng.randint(4, 9))]
                sentences.append(" ".join(w).capitalize() + ".")
        doc = " ".join(sentences)
        docs.append(doc)
        total += len(doc) + 2
    return docs


_SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet"}


def corpus_files(paths: Sequence[str]) -> List[str]:
    """``paths`` with every directory replaced by its corpus files (``.txt``/``.text``/``.md``,
    ``.json``/``.jsonl``, ``.parquet``; sorted by name; not recursive; other files skipped, as
    the fine-tune's ``--data`` reads a directory).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a directory holds no corpus file.
    """
    files: List[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.iterdir() if f.is_file()
                           and f.suffix.lower() in _SUFFIXES)
            if not found:
                raise ValueError(f"corpus directory {p} holds no {'/'.join(_SUFFIXES)} file "
                                 f"(subdirectories are not read)")
            files.extend(found)
        elif path.is_file():
            files.append(str(p))
        else:
            raise FileNotFoundError(f"corpus file or directory not found: {p}")
    return files


def load_corpus(
    paths: Optional[Sequence[str]] = None,
    *,
    text_field: str = "text",
    num_chars: int = 200_000,
) -> List[str]:
    """Documents from local text / jsonl / parquet files, or the built-in corpus.

    Args:
        paths: local files or directories of them (:func:`corpus_files`), all of one kind:
            ``.txt``/``.text``/``.md`` → each file is ONE
            document, read whole as UTF-8 with its newlines (a line per document, as
            ``datasets``' "text" builder reads by default, drops the newlines and puts an EOS
            between lines: SmolLM2-135M's perplexity on held-out Shakespeare at 1K context
            went from 27.9 to 53.7);
            ``.json``/``.jsonl`` and ``.parquet`` → one document per row, read with ``datasets``.
            None or empty: :func:`builtin_corpus`.
        text_field: the column holding the text (json / parquet).
        num_chars: size of the built-in corpus.

    Returns:
        A list of non-empty document strings, in the order of ``paths`` (rows in file order).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: mixed or unknown file kinds, a directory without corpus files, an empty
            file, a text file that is not UTF-8, a missing text column, or no text at all.
    """
    if not paths:
        return builtin_corpus(num_chars)
    paths = corpus_files(paths)
    kinds = {_file_kind(p) for p in paths}
    if len(kinds) != 1:
        raise ValueError(f"corpus files must all be of one kind, got {sorted(kinds)} for {list(paths)}")
    for p in paths:
        if Path(p).stat().st_size == 0:
            raise ValueError(f"corpus file is empty: {p}")
    kind = kinds.pop()
    if kind == "text":
        docs = []
        for p in paths:
            try:
                text = Path(p).read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"corpus file {p} is not UTF-8 text ({e.reason} at byte "
                                 f"{e.start})") from None
            if not text.strip():
                raise ValueError(f"corpus file {p} holds only whitespace")
            docs.append(text)
        return docs
    import datasets

    ds = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
    if text_field not in ds.column_names:
        raise ValueError(
            f"corpus has no column {text_field!r}; columns are {ds.column_names} "
            f"(choose one with --text-field)"
        )
    docs = [t for t in ds[text_field] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ValueError(f"corpus {list(paths)} holds no text in column {text_field!r}")
    return docs


def _file_kind(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in _SUFFIXES:
        return _SUFFIXES[suffix]
    raise ValueError(
        f"unknown corpus file kind {suffix!r} for {path}; accepted: .txt/.text/.md, "
        f".json/.jsonl, .parquet"
    )


def build_char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over printable ASCII (no training needed).

    Every printable ASCII character is one token, digits included, so a passkey is one token per
    digit and decodes back exactly. Special tokens: ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``
    (anything outside printable ASCII). Vocabulary size: 101.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(list(_SPECIALS) + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own pre-token; Fuse joins decoded characters without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=1 << 30,
    )


def build_default_model(tokenizer, *, seed: int = 0, **overrides):
    """The tiny random-initialised Llama of the built-in default (``DEFAULT_MODEL_CONFIG``).

    Args:
        tokenizer: gives the vocabulary size and special token ids.
        seed: initialisation seed (the weights are a pure function of it).
        overrides: LlamaConfig fields replacing the defaults.

    Returns:
        A ``LlamaForCausalLM`` in float32, eval mode, ``attn_implementation="sdpa"``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(DEFAULT_MODEL_CONFIG)
    cfg.update(overrides)
    vocab = len(tokenizer)
    config = LlamaConfig(
        vocab_size=((vocab + 63) // 64) * 64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **cfg,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def tokenize_corpus(tokenizer, docs: Iterable[str], max_tokens: int) -> torch.Tensor:
    """One token stream ``[N]`` (documents joined by EOS), at most ``max_tokens`` long."""
    ids: List[int] = []
    eos = tokenizer.eos_token_id
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)
