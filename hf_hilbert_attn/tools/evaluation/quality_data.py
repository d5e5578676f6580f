"""The quality study's inputs and records: the methods file (:func:`load_methods`), the corpus
documents (:func:`read_documents`) and the rows of ``OUT/quality.csv`` (one per finished cell).
"""

from __future__ import annotations

import csv
import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hf_hilbert_attn.pattern import DilatedPattern

from ._args import InputError


STAGES = ("base", "finetuned")
TASKS = ("perplexity", "passkey")
IMPLEMENTATIONS = ("sdpa", "hilbert_dilated")
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # also a directory name under OUT/finetune

# quality.csv, long format: one row per finished cell (per depth for passkey).
CSV_FIELDS = ["method", "stage", "task", "length", "depth", "value", "n", "correct", "density",
              "seconds", "tokens_per_s", "final_loss", "peak_mem_mb", "attn_implementation",
              "pattern", "dtype", "device", "answers"]
_INT_FIELDS = ("length", "n", "correct")
_FLOAT_FIELDS = ("value", "density", "seconds", "tokens_per_s", "final_loss", "peak_mem_mb")

class StudyError(InputError):
    """A bad input of the study (directory, methods file, pattern, setting): one line, no trace."""


# ----------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class QualityMethod:
    """One row of the methods file: an attention implementation and, for hilbert_dilated, its
    pattern."""

    label: str
    attn_implementation: str
    pattern: Optional[DilatedPattern] = None
    pattern_name: str = ""  # how the file named it: a configs/ name, a path, or "inline"

    @property
    def pattern_text(self) -> str:
        if self.pattern is None:
            return "dense (sdpa)"
        cfg = ",".join(str(w) for w in self.pattern.segment_lengths) + ":" + ",".join(
            str(r) for r in self.pattern.dilation_rates)
        extra = f" {self.pattern.window}" + (f" sinks={self.pattern.sink_tokens}"
                                             if self.pattern.sink_tokens else "")
        name = f"{self.pattern_name} " if self.pattern_name not in ("", "inline") else ""
        return f"{name}[{cfg}]{extra}"


def load_methods(spec, base_dir: Optional[Path] = None) -> List[QualityMethod]:
    """Methods from a YAML file (``methods:`` list, or a bare list) or from a list of dicts.

    Each entry: ``label`` (letters, digits, ``_ . + -``; unique), ``attn_implementation``
    (``sdpa`` or ``hilbert_dilated``; default ``hilbert_dilated`` when a pattern is given, else
    ``sdpa``) and, for hilbert_dilated, ``pattern``: a shipped pattern name (``default``,
    ``longnet_lm``, ...), a YAML path (relative paths are tried from the current directory, then
    from the methods file's), or an inline dict with ``segment_lengths``, ``dilation_rates`` and
    optionally ``query_dilation``, ``sink_tokens``, ``window``, ``ordering``.

    Raises:
        StudyError: a missing or unreadable file, or a bad entry (named by index and label).
    """
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        data, base_dir, where = _read_yaml(path), path.resolve().parent, str(path)
    else:
        data, where = spec, "methods"
    if isinstance(data, dict):
        data = data.get("methods")
    if not isinstance(data, list) or not data:
        raise StudyError(f"{where} must hold a non-empty list 'methods:' of entries with label, "
                         f"attn_implementation and pattern")
    seen: set = set()
    return [_method(entry, f"{where}: methods[{i}]", seen, base_dir)
            for i, entry in enumerate(data)]


def _read_yaml(path: Path):
    if not path.is_file():
        raise StudyError(f"methods file not found: {path}")
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise StudyError(f"methods file {path} is not valid YAML: "
                         f"{str(e).splitlines()[0]}") from None


def _method(entry, at: str, seen: set, base_dir: Optional[Path]) -> QualityMethod:
    """One entry of the methods list, checked (``at`` names it in errors; ``seen``: the labels
    so far)."""
    from ._args import resolve_pattern

    if not isinstance(entry, dict):
        raise StudyError(f"{at} must be a mapping with label / attn_implementation / "
                         f"pattern, got {entry!r}")
    unknown = set(entry) - {"label", "attn_implementation", "pattern", "description"}
    if unknown:
        raise StudyError(f"{at}: unknown field(s) {sorted(unknown)}; known: label, "
                         f"attn_implementation, pattern, description")
    label = str(entry.get("label", ""))
    if not _LABEL.match(label):
        raise StudyError(f"{at}: label must be letters, digits, '_', '.', '+' or '-' "
                         f"(it names a directory), got {label!r}")
    at = f"{at} ({label})"
    if label in seen:
        raise StudyError(f"{at}: duplicate label")
    seen.add(label)
    spec_p = entry.get("pattern")
    impl = entry.get("attn_implementation", "hilbert_dilated" if spec_p is not None else "sdpa")
    if impl not in IMPLEMENTATIONS:
        raise StudyError(f"{at}: attn_implementation must be one of {list(IMPLEMENTATIONS)}, "
                         f"got {impl!r}")
    if impl == "sdpa":
        if spec_p is not None:
            raise StudyError(f"{at}: sdpa takes no pattern (it is the dense control)")
        return QualityMethod(label, impl)
    if spec_p is None:
        raise StudyError(f"{at}: hilbert_dilated needs a pattern (a shipped name, a YAML "
                         f"path or an inline dict)")
    try:
        if isinstance(spec_p, dict):
            pattern, name = DilatedPattern.from_dict(spec_p), "inline"
        elif isinstance(spec_p, str):
            p = Path(spec_p)
            if p.suffix in (".yaml", ".yml") and not p.is_file() and base_dir is not None \
                    and not p.is_absolute() and (base_dir / p).is_file():
                spec_p = str(base_dir / p)
            name, pattern = resolve_pattern(spec_p)
        else:
            raise ValueError(f"pattern must be a name, a YAML path or a dict, got {spec_p!r}")
    except (ValueError, FileNotFoundError) as e:
        raise StudyError(f"{at}: {e}") from None
    return QualityMethod(label, impl, pattern, name)


def filter_methods(methods: Sequence[QualityMethod],
                   patterns: Sequence[str]) -> List[QualityMethod]:
    """The methods whose label matches any of ``patterns`` (shell globs); all when empty."""
    if not patterns:
        return list(methods)
    keep = [m for m in methods if any(fnmatch.fnmatchcase(m.label, p) for p in patterns)]
    if not keep:
        raise StudyError(f"--methods-filter {list(patterns)} matches no label of "
                         f"{[m.label for m in methods]}")
    return keep


# ----------------------------------------------------------------------------- data
def read_documents(directory) -> List[str]:
    """The ``.txt`` files of ``directory``, sorted by name, each one whole document.

    Raises:
        StudyError: no such directory or no non-empty ``.txt`` file in it.
    """
    d = Path(directory)
    if not d.is_dir():
        raise StudyError(f"corpus directory not found: {d}")
    docs = [f.read_text(encoding="utf-8") for f in sorted(d.glob("*.txt")) if f.is_file()]
    docs = [t for t in docs if t.strip()]
    if not docs:
        raise StudyError(f"{d} holds no non-empty .txt file (each .txt file is one document)")
    return docs


# ----------------------------------------------------------------------------- CSV
def _row(**kw) -> Dict:
    row = {k: "" for k in CSV_FIELDS}
    row.update(kw)
    return row


def append_rows(path: Path, rows: Sequence[Dict]) -> None:
    """Append rows to the long-format CSV (header written on first use) and flush to disk."""
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
        f.flush()
        os.fsync(f.fileno())


def read_rows(path) -> List[Dict]:
    """The rows of a ``quality.csv``, numbers converted back (empty cells stay ``""``)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in _INT_FIELDS:
            if r.get(k, "") != "":
                r[k] = int(float(r[k]))
        for k in _FLOAT_FIELDS + ("depth",):
            if r.get(k, "") != "":
                r[k] = float(r[k])
    return rows


def _cell_key(r: Dict) -> Tuple:
    return (r["method"], r["stage"], r["task"], int(r["length"]),
            "" if r["depth"] == "" else float(r["depth"]))
