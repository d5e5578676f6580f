"""Quality of dilated patterns on a real model: perplexity and passkey retrieval against dense
``sdpa`` on the same held-out text, before and after the same short fine-tune.

    hf-hilbert-attn quality --model smollm2 --corpus shakespeare \\
        --finetune-steps 150 --out quality_results

For every method of the methods file (``sdpa``, or ``hilbert_dilated`` with a pattern) and every
stage (``base``: the model as given; ``finetuned``: after ``hf_hilbert_attn.tools.finetune`` (``examples/finetune.py``) ran on
``CORPUS/train`` with the same data order, steps, learning rate and seed for every method, the
dense ``sdpa`` control included), it measures

* perplexity at each ``--lengths`` on one held-out token stream (``CORPUS/heldout/*.txt``, one
  document per file, joined by EOS): windows of ``L`` tokens every ``L/2``, each token scored
  once (:mod:`~hf_hilbert_attn.tools.evaluation.perplexity`), the same windows for every method;
* passkey accuracy at each ``--passkey-lengths`` × ``--depths`` × ``--trials``, teacher-forced
  and batched (:func:`~hf_hilbert_attn.tools.evaluation.passkey.passkey_teacher_forced`);
* the pattern's density (allowed / dense causal pairs) at each length, wall time, and for the
  fine-tune its seconds per step and tokens/s.

Every finished cell is appended to ``OUT/quality.csv`` at once and the tables (``quality.md``)
are rewritten after each (method, stage); the plots (``quality_ppl.png``,
``quality_passkey.png``) are drawn at the end. A run stopped midway keeps what finished: run the
same command again and it goes on where it stopped (``--fresh`` starts over), or draw what
there is with ``--report-only OUT``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fnmatch
import gc
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import hf_hilbert_attn
from hf_hilbert_attn.pattern import DilatedPattern

from ._args import (InputError, check_device, check_eval_grid, depth, length_type, nonneg_int,
                    positive_int, results_dir, show_progress)
from .corpus import tokenize_corpus
from .measure import Meter
from .passkey import check_prompt_fits, evaluate_passkey_teacher_forced
from .perplexity import PerplexityResult, strided_windows
from .report import _plt, markdown_table

logger = logging.getLogger(__name__)

__all__ = ["QualityMethod", "QualityConfig", "load_methods", "read_documents", "pattern_density",
           "perplexity_batched", "run_quality_study", "write_quality_report",
           "add_quality_arguments", "main"]

# the fine-tune subprocess imports the package from here
PACKAGE_PARENT = Path(hf_hilbert_attn.__file__).resolve().parents[1]
DEFAULT_METHODS = Path(__file__).with_name("quality_study.yaml")  # installed with the package
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
# Settings that change the numbers: a resumed run must use the same ones.
_VALUE_SETTINGS = ("model", "corpus", "ppl_tokens", "depths", "trials", "seed", "dtype",
                   "finetune_steps", "finetune_lr", "finetune_warmup", "finetune_seq_len",
                   "finetune_args")


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
    ``sdpa``) and, for hilbert_dilated, ``pattern``: a ``configs/`` name (``default``,
    ``longnet_lm``, ...), a YAML path (relative paths are tried from the current directory, then
    from the methods file's), or an inline dict with ``segment_lengths``, ``dilation_rates`` and
    optionally ``query_dilation``, ``sink_tokens``, ``window``, ``ordering``.

    Raises:
        StudyError: a missing or unreadable file, or a bad entry (named by index and label).
    """
    from .runner import resolve_pattern

    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.is_file():
            raise StudyError(f"methods file not found: {path}")
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise StudyError(f"methods file {path} is not valid YAML: "
                             f"{str(e).splitlines()[0]}") from None
        base_dir = path.resolve().parent
        where = str(path)
    else:
        data, where = spec, "methods"
    if isinstance(data, dict):
        data = data.get("methods")
    if not isinstance(data, list) or not data:
        raise StudyError(f"{where} must hold a non-empty list 'methods:' of entries with label, "
                         f"attn_implementation and pattern")
    methods, seen = [], set()
    for i, entry in enumerate(data):
        at = f"{where}: methods[{i}]"
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
        impl = entry.get("attn_implementation",
                         "hilbert_dilated" if spec_p is not None else "sdpa")
        if impl not in IMPLEMENTATIONS:
            raise StudyError(f"{at}: attn_implementation must be one of {list(IMPLEMENTATIONS)}, "
                             f"got {impl!r}")
        if impl == "sdpa":
            if spec_p is not None:
                raise StudyError(f"{at}: sdpa takes no pattern (it is the dense control)")
            methods.append(QualityMethod(label, impl))
            continue
        if spec_p is None:
            raise StudyError(f"{at}: hilbert_dilated needs a pattern (a configs/ name, a YAML "
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
        methods.append(QualityMethod(label, impl, pattern, name))
    return methods


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


# ----------------------------------------------------------------------------- measurements
_DENSITY: Dict[Tuple, float] = {}


def pattern_density(pattern: Optional[DilatedPattern], length: int, num_heads: int,
                    device=None) -> float:
    """Allowed causal pairs / dense causal pairs at ``length``, over ``num_heads`` query heads
    (1.0 for ``None``, i.e. sdpa); exact (:meth:`DilatedPattern.count_pairs_total`)."""
    if pattern is None or pattern.is_dense_for(length):
        return 1.0
    key = (pattern, int(length), int(num_heads))
    if key not in _DENSITY:
        pairs = pattern.count_pairs_total(length, num_heads)
        _DENSITY[key] = pairs / (num_heads * length * (length + 1) / 2)
    return _DENSITY[key]


@torch.inference_mode()
def perplexity_batched(model, tokens: torch.Tensor, length: int, stride: int, *,
                       max_batch_tokens: int = 65536, progress=None) -> PerplexityResult:
    """:func:`~hf_hilbert_attn.tools.evaluation.perplexity.evaluate_perplexity` with windows batched.

    The windows (and so the scored tokens) are those of ``strided_windows``; windows of equal
    size and scored count run together, ``[B, L]`` with ``B * L <= max_batch_tokens``, and only
    the logits predicting scored tokens are kept (``logits_to_keep``; about
    ``max_batch_tokens / 2 × vocab`` values at stride ``L/2``). The cross-entropy is float32.
    """
    device = next(model.parameters()).device
    groups: "OrderedDict[Tuple[int, int], List[int]]" = OrderedDict()
    for begin, end, scored in strided_windows(int(tokens.numel()), length, stride):
        groups.setdefault((end - begin, scored), []).append(begin)
    nll, scored_total, processed, windows = 0.0, 0, 0, 0
    for (size, scored), begins in groups.items():
        per = max(1, max_batch_tokens // size)
        for i in range(0, len(begins), per):
            chunk = begins[i:i + per]
            ids = torch.stack([tokens[b:b + size] for b in chunk]).to(device)  # [B, size]
            logits = model(input_ids=ids, logits_to_keep=scored + 1, use_cache=False).logits
            logits = logits[:, -(scored + 1):-1].flatten(0, 1)  # [B * scored, V]
            targets = ids[:, size - scored:].flatten()
            for j in range(0, targets.numel(), 4096):
                nll += float(F.cross_entropy(logits[j:j + 4096].float(), targets[j:j + 4096],
                                             reduction="sum"))
            scored_total += scored * len(chunk)
            processed += size * len(chunk)
            windows += len(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return PerplexityResult(length, stride, nll, scored_total, processed, windows)


# ----------------------------------------------------------------------------- configuration
@dataclass
class QualityConfig:
    """Everything :func:`run_quality_study` needs; defaults are those of the command line."""

    model: str = ""
    corpus: str = ""
    methods: object = str(DEFAULT_METHODS)  # a YAML path or a list of method dicts
    methods_filter: Sequence[str] = ()
    out: str = results_dir("quality")
    lengths: Sequence[int] = (1024, 2048, 4096, 8192)
    ppl_tokens: int = 65536
    passkey_lengths: Sequence[int] = (1024, 2048, 4096, 8192)
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 6
    tasks: Sequence[str] = TASKS
    stages: Sequence[str] = ()  # default: base, plus finetuned when finetune_steps > 0
    finetune_steps: int = 0
    finetune_lr: float = 1e-4
    finetune_warmup: int = 10
    finetune_seq_len: int = 8192
    finetune_args: str = ""  # more arguments for hf_hilbert_attn.tools.finetune, e.g. "--loss-chunk 4096"
    batch_tokens: int = 65536
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    fresh: bool = False
    plots: bool = True
    progress: bool = True

    def resolved_stages(self) -> Tuple[str, ...]:
        if self.stages:
            return tuple(s for s in STAGES if s in self.stages)
        return STAGES if self.finetune_steps > 0 else ("base",)


def _device_and_dtype(cfg: QualityConfig):
    """``(device, weight dtype, autocast dtype or None, label)``: fp32 weights with bf16 autocast
    on CUDA (as training runs), fp32 on CPU, unless ``--dtype`` says otherwise."""
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    mode = cfg.dtype
    if mode == "auto":
        mode = "autocast-bf16" if device.type == "cuda" else "float32"
    if mode == "autocast-bf16":
        return device, torch.float32, torch.bfloat16, mode
    return device, getattr(torch, mode), None, mode


def _validate(cfg: QualityConfig) -> None:
    model = Path(cfg.model) if cfg.model else None
    if model is None:
        raise StudyError("--model is required: a local Hugging Face model directory (e.g. from "
                         "`hf-hilbert-attn fetch-model smollm2 DIR`)")
    if not model.is_dir():
        raise StudyError(f"model directory not found: {model}")
    if not (model / "config.json").is_file():
        raise StudyError(f"{model} is not a Hugging Face model directory (no config.json)")
    if not cfg.corpus:
        raise StudyError("--corpus is required: a directory with train/ and heldout/ of .txt "
                         "files (e.g. from `hf-hilbert-attn fetch-corpus shakespeare DIR`)")
    corpus = Path(cfg.corpus)
    if not corpus.is_dir():
        raise StudyError(f"corpus directory not found: {corpus}")
    if "perplexity" in cfg.tasks and not (corpus / "heldout").is_dir():
        raise StudyError(f"{corpus} has no heldout/ directory of .txt files")
    stages = cfg.resolved_stages()
    if "finetuned" in stages:
        if cfg.finetune_steps < 1:
            raise StudyError("the finetuned stage needs --finetune-steps >= 1")
        if not (corpus / "train").is_dir():
            raise StudyError(f"{corpus} has no train/ directory of .txt files (fine-tuning data)")
        if cfg.finetune_seq_len < 2:
            raise StudyError(f"--finetune-seq-len must be >= 2, got {cfg.finetune_seq_len}")
    check_eval_grid(cfg.tasks, TASKS, cfg.lengths, cfg.passkey_lengths, cfg.depths, cfg.trials,
                    error=StudyError)
    try:
        check_device(cfg.device)
    except InputError as e:
        raise StudyError(str(e)) from None
    if cfg.trials < 1 or cfg.ppl_tokens < 2 or cfg.batch_tokens < 1:
        raise StudyError(f"need trials >= 1, ppl_tokens >= 2, batch_tokens >= 1; got "
                         f"{cfg.trials}, {cfg.ppl_tokens}, {cfg.batch_tokens}")


def _settings(cfg: QualityConfig, dtype_label: str) -> Dict:
    return dict(model=str(Path(cfg.model).resolve()), corpus=str(Path(cfg.corpus).resolve()),
                ppl_tokens=int(cfg.ppl_tokens), depths=[float(d) for d in cfg.depths],
                trials=int(cfg.trials), seed=int(cfg.seed), dtype=dtype_label,
                finetune_steps=int(cfg.finetune_steps), finetune_lr=float(cfg.finetune_lr),
                finetune_warmup=int(cfg.finetune_warmup),
                finetune_seq_len=int(cfg.finetune_seq_len), finetune_args=cfg.finetune_args)


def _method_record(m: QualityMethod) -> Dict:
    return dict(attn_implementation=m.attn_implementation,
                pattern=m.pattern.to_dict() if m.pattern is not None else None,
                pattern_name=m.pattern_name)


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


# ----------------------------------------------------------------------------- the study
@dataclass
class _Study:
    cfg: QualityConfig
    out: Path
    device: torch.device
    weight_dtype: torch.dtype
    autocast: Optional[torch.dtype]
    dtype_label: str
    rows: List[Dict] = field(default_factory=list)
    done: set = field(default_factory=set)
    errors: List[str] = field(default_factory=list)
    settings: Dict = field(default_factory=dict)

    @property
    def csv(self) -> Path:
        return self.out / "quality.csv"

    def add(self, rows: Sequence[Dict]) -> None:
        append_rows(self.csv, rows)
        self.rows.extend(rows)
        self.done.update(_cell_key(r) for r in rows)

    def is_done(self, method, stage, task, length, depth="") -> bool:
        return (method, stage, task, int(length), depth) in self.done

    def amp(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)


def _prepare_out(cfg: QualityConfig, methods: Sequence[QualityMethod], dtype_label: str,
                 study: _Study) -> None:
    """Create OUT, check a previous run's settings (resume) or start afresh, write study.json."""
    out = study.out
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "study.json"
    settings = _settings(cfg, dtype_label)
    if cfg.fresh:
        for name in ("quality.csv", "study.json"):
            (out / name).unlink(missing_ok=True)
    meta = {"settings": settings, "methods": {}}
    if study.csv.exists():
        old = json.loads(meta_path.read_text()) if meta_path.exists() else None
        if old is None:
            raise StudyError(f"{out} has a quality.csv but no study.json: use --fresh or another "
                             f"--out")
        diff = [k for k in _VALUE_SETTINGS if old["settings"].get(k) != settings.get(k)]
        if diff:
            what = ", ".join(f"{k}: {old['settings'].get(k)!r} -> {settings.get(k)!r}"
                             for k in diff)
            raise StudyError(f"{out} holds results of other settings ({what}); use --fresh to "
                             f"start over or another --out")
        for m in methods:
            rec = old["methods"].get(m.label)
            if rec is not None and rec != _method_record(m):
                raise StudyError(f"{out} has results of another method labelled {m.label!r} "
                                 f"({rec}); rename it, use --fresh or another --out")
        meta["methods"] = old["methods"]
        study.rows = read_rows(study.csv)
        study.done = {_cell_key(r) for r in study.rows}
    for m in methods:
        meta["methods"][m.label] = _method_record(m)
    meta_path.write_text(json.dumps(meta, indent=1))
    study.settings = settings


def _load_model(path, method: QualityMethod, study: _Study):
    from transformers import AutoModelForCausalLM

    import hf_hilbert_attn

    model = AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation=method.attn_implementation, dtype=study.weight_dtype)
    if method.pattern is not None:
        hf_hilbert_attn.configure(model, method.pattern)
    return model.to(study.device).eval()


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _eval_cells(method: QualityMethod, stage: str, study: _Study) -> List[Tuple[str, int]]:
    cfg = study.cfg
    cells = []
    if "perplexity" in cfg.tasks:
        cells += [("perplexity", L) for L in cfg.lengths
                  if not study.is_done(method.label, stage, "perplexity", L)]
    if "passkey" in cfg.tasks:
        cells += [("passkey", L) for L in cfg.passkey_lengths
                  if not all(study.is_done(method.label, stage, "passkey", L, float(d))
                             for d in cfg.depths)]
    return cells


def _evaluate(model_path, method: QualityMethod, stage: str, cells, tokens, tokenizer,
              study: _Study, bar) -> None:
    """Run the pending eval cells of one (method, stage) on one loaded model."""
    cfg = study.cfg
    model = _load_model(model_path, method, study)
    heads = model.config.num_attention_heads
    common = dict(method=method.label, stage=stage, attn_implementation=method.attn_implementation,
                  pattern=method.pattern_text, dtype=study.dtype_label, device=str(study.device))
    try:
        for task, L in cells:
            bar.set_postfix_str(f"{method.label} {stage} {task} {L}")
            density = pattern_density(method.pattern, L, heads, study.device)
            if task == "perplexity":
                with Meter(study.device) as m, study.amp():
                    res = perplexity_batched(model, tokens, L, max(1, L // 2),
                                             max_batch_tokens=cfg.batch_tokens)
                study.add([_row(**common, task=task, length=L, value=res.perplexity,
                                n=res.scored_tokens, density=density, seconds=m.seconds,
                                tokens_per_s=res.processed_tokens / max(m.seconds, 1e-9),
                                peak_mem_mb=m.peak_bytes / 2**20)])
            else:
                with Meter(study.device) as m, study.amp():
                    res = evaluate_passkey_teacher_forced(
                        model, tokenizer, L, cfg.depths, cfg.trials, seed=cfg.seed,
                        max_batch_tokens=cfg.batch_tokens)
                tps = sum(r["prompt_tokens"] for r in res) / max(m.seconds, 1e-9)
                study.add([_row(**common, task=task, length=L, depth=r["depth"],
                                value=r["accuracy"], n=r["trials"], correct=r["correct"],
                                density=density, seconds=m.seconds, tokens_per_s=tps,
                                peak_mem_mb=m.peak_bytes / 2**20,
                                answers=" | ".join(a.replace("\n", "\\n") for a in r["answers"]))
                           for r in res])
            bar.update(1)
    finally:
        del model
        _free(study.device)


def _finetune(method: QualityMethod, study: _Study, bar) -> Path:
    """Fine-tune ``method`` from the base weights with ``hf_hilbert_attn.tools.finetune`` (one process);
    returns ``OUT/finetune/<label>/final`` and records the step time and tokens/s."""
    cfg = study.cfg
    ft = study.out / "finetune" / method.label
    final = ft / "final"
    if study.is_done(method.label, "finetuned", "finetune", cfg.finetune_seq_len):
        if not (final / "config.json").is_file():
            raise RuntimeError(f"quality.csv has the fine-tune of {method.label} but {final} is "
                               f"gone: use --fresh or another --out")
        return final
    if ft.exists():  # an interrupted fine-tune starts over
        shutil.rmtree(ft)
    ft.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hf_hilbert_attn.tools.finetune", "--model", str(Path(cfg.model).resolve()),
           "--data", str((Path(cfg.corpus) / "train").resolve()),
           "--attn-implementation", method.attn_implementation,
           "--seq-len", str(cfg.finetune_seq_len), "--max-steps", str(cfg.finetune_steps),
           "--lr", repr(float(cfg.finetune_lr)), "--warmup-steps", str(cfg.finetune_warmup),
           "--seed", str(cfg.seed), "--save-every", "0", "--log-every", "1",
           "--output-dir", str(ft.resolve())]
    if method.pattern is not None:
        method.pattern.to_yaml(ft / "pattern.yaml")
        cmd += ["--pattern", str((ft / "pattern.yaml").resolve())]
    cmd += shlex.split(cfg.finetune_args)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_PARENT),
                                                        os.environ.get("PYTHONPATH")])))
    if study.device.type == "cuda" and study.device.index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(study.device.index)
    (ft / "command.txt").write_text(shlex.join(cmd) + "\n")
    log_path, train_log = ft / "finetune.log", ft / "train_log.jsonl"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                last = _last_line(train_log)
                if last:
                    rec = json.loads(last)
                    bar.set_postfix_str(f"{method.label} finetune step {rec['step']}/"
                                        f"{cfg.finetune_steps} loss {rec['loss']:.3f}")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not (ft / "train_stats.json").is_file():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"fine-tuning {method.label} failed (exit {proc.returncode}): "
                           f"{tail[0]} — full log: {log_path}")
    stats = json.loads((ft / "train_stats.json").read_text())
    peak = stats.get("peak_mem_gib")
    study.add([_row(method=method.label, stage="finetuned", task="finetune",
                    length=cfg.finetune_seq_len, value=stats["seconds_per_step"],
                    n=stats["steps"], seconds=seconds, tokens_per_s=stats["tokens_per_s"],
                    final_loss=stats.get("final_loss_mean10", stats["final_loss"]),
                    peak_mem_mb=peak * 1024 if peak is not None else "",
                    attn_implementation=method.attn_implementation, pattern=method.pattern_text,
                    dtype=stats.get("mixed_precision", ""), device=str(study.device))])
    return final


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text().strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _run_block(method: QualityMethod, stage: str, cells, finetune: bool, tokens, tokenizer,
               study: _Study, bar) -> None:
    """One (method, stage): its fine-tune first if due, then its pending eval cells. A failure
    is recorded (``errors.log``, the report) and the study goes on with the next block."""
    try:
        path = Path(study.cfg.model)
        if stage == "finetuned":
            if finetune:
                bar.set_postfix_str(f"{method.label} finetune")
            path = _finetune(method, study, bar)
            if finetune:
                bar.update(1)
        if cells:
            _evaluate(path, method, stage, cells, tokens, tokenizer, study, bar)
    except Exception as e:  # noqa: BLE001 - one failed method must not stop the others
        first = str(e).splitlines()[0] if str(e) else ""
        msg = f"{method.label} ({stage}): {type(e).__name__}: {first}"
        study.errors.append(msg)
        with open(study.out / "errors.log", "a") as f:
            f.write(f"== {msg}\n{traceback.format_exc()}\n")
        logger.error("failed: %s (traceback in %s)", msg, study.out / "errors.log")
        _free(study.device)


def run_quality_study(cfg: QualityConfig) -> Dict:
    """Run the study of ``cfg`` (see the module docstring) and write its files into ``cfg.out``.

    Returns:
        ``{"rows": [...], "files": {...}, "markdown": str, "errors": [...]}``; ``errors`` lists
        the (method, stage) blocks that failed at run time (the others still ran).

    Raises:
        StudyError: a bad input (missing directory, methods file, pattern, setting), before any
            model is loaded.
    """
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    _validate(cfg)
    methods = filter_methods(load_methods(cfg.methods), cfg.methods_filter)
    device, weight_dtype, autocast, dtype_label = _device_and_dtype(cfg)
    study = _Study(cfg, Path(cfg.out), device, weight_dtype, autocast, dtype_label)
    stages = cfg.resolved_stages()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    if "passkey" in cfg.tasks:  # fail before any model runs if the shortest prompt cannot fit
        check_prompt_fits(tokenizer, min(cfg.passkey_lengths), StudyError)
    tokens = None
    if "perplexity" in cfg.tasks:
        tokens = tokenize_corpus(tokenizer, read_documents(Path(cfg.corpus) / "heldout"),
                                 cfg.ppl_tokens)
        if tokens.numel() < 2:
            raise StudyError("the held-out corpus tokenised to fewer than 2 tokens")
    _prepare_out(cfg, methods, dtype_label, study)
    study.settings["heldout_tokens"] = int(tokens.numel()) if tokens is not None else 0
    meta = json.loads((study.out / "study.json").read_text())
    meta["settings"]["heldout_tokens"] = study.settings["heldout_tokens"]
    (study.out / "study.json").write_text(json.dumps(meta, indent=1))

    plan = []  # (method, stage, eval cells, needs a fine-tune)
    for m in methods:
        for stage in stages:
            ft = stage == "finetuned" and not study.is_done(m.label, stage, "finetune",
                                                            cfg.finetune_seq_len)
            plan.append((m, stage, _eval_cells(m, stage, study), ft))
    total = sum(len(c) + ft for _, _, c, ft in plan)
    if study.done:
        logger.info("resuming in %s: %d rows already there; %d cells to run", study.out,
                    len(study.rows), total)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per model load would bury ours
    try:
        with tqdm(total=total, desc="quality", unit="cell", disable=not show_progress(cfg.progress),
                  dynamic_ncols=True, mininterval=2.0) as bar:
            for m, stage, cells, ft in plan:
                _run_block(m, stage, cells, ft, tokens, tokenizer, study, bar)
                if cells or ft:  # tables after every block; plots (a second or two) at the end
                    write_quality_report(study.out, plots=False, errors=study.errors,
                                         missing_ok=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    out = write_quality_report(study.out, plots=cfg.plots, errors=study.errors, missing_ok=True)
    out["rows"] = study.rows
    out["errors"] = study.errors
    return out


# ----------------------------------------------------------------------------- report
def _ordered(values) -> List:
    return list(OrderedDict.fromkeys(values))


def _reference(rows) -> Optional[str]:
    """The dense control: the first method that ran with sdpa."""
    return next((r["method"] for r in rows if r["attn_implementation"] == "sdpa"), None)


def _passkey_cells(rows):
    """``{(method, stage, length): (correct, trials)}`` summed over depths."""
    acc: Dict[Tuple, List[int]] = {}
    for r in rows:
        if r["task"] == "passkey":
            c = acc.setdefault((r["method"], r["stage"], r["length"]), [0, 0])
            c[0] += int(r["correct"])
            c[1] += int(r["n"])
    return acc


def quality_markdown(rows: Sequence[Dict], settings: Optional[Dict] = None,
                     errors: Sequence[str] = ()) -> str:
    """The study's tables from its rows (see :func:`write_quality_report`)."""
    parts = ["# Quality study: dilated patterns vs dense sdpa"]
    if settings:
        s = settings
        parts.append(
            f"\nModel `{s.get('model')}`, corpus `{s.get('corpus')}` (held-out stream "
            f"{s.get('heldout_tokens', '?')} tokens), {s.get('dtype')}; passkey "
            f"{len(s.get('depths', []))} depths x {s.get('trials')} trials, teacher-forced; "
            f"fine-tune {s.get('finetune_steps')} steps of {s.get('finetune_seq_len')} tokens, "
            f"lr {s.get('finetune_lr')}, warm-up {s.get('finetune_warmup')}, seed {s.get('seed')}"
            + (f", extra `{s['finetune_args']}`" if s.get("finetune_args") else "") + ".")
    ref = _reference(rows)
    methods = _ordered(r["method"] for r in rows)
    stages = [s for s in STAGES if any(r["stage"] == s for r in rows)]
    meta = {r["method"]: r for r in rows}

    dens = {(r["method"], r["length"]): r["density"] for r in rows
            if r["task"] in TASKS and r["density"] != ""}
    if dens:
        lengths = sorted({L for _, L in dens})
        parts.append("\n## Methods and density (allowed / dense causal pairs, all heads)\n")
        body = [[m, meta[m]["attn_implementation"], meta[m]["pattern"]]
                + [f"{100 * dens[(m, L)]:.2f} %" if (m, L) in dens else "" for L in lengths]
                for m in methods]
        parts.append(markdown_table(["method", "attention", "pattern"]
                                    + [str(L) for L in lengths], body))

    ppl = {(r["method"], r["stage"], r["length"]): r["value"] for r in rows
           if r["task"] == "perplexity"}
    if ppl:
        lengths = sorted({k[2] for k in ppl})
        n_scored = next(r["n"] for r in rows if r["task"] == "perplexity")
        parts.append(f"\n## Perplexity by context length (held-out stream, windows of L every "
                     f"L/2, each of {n_scored} tokens scored once)\n")
        keys = [(m, s) for m in methods for s in stages
                if any((m, s, L) in ppl for L in lengths)]
        parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths],
                                    [[m, s] + [f"{ppl[(m, s, L)]:.3f}" if (m, s, L) in ppl
                                               else "" for L in lengths] for m, s in keys]))
        if ref is not None:
            parts.append(f"\nRatio to dense `{ref}` of the same stage (1.00 = as good as dense):\n")
            body = []
            for m, s in keys:
                row = [m, s]
                for L in lengths:
                    a, b = ppl.get((m, s, L)), ppl.get((ref, s, L))
                    row.append(f"{a / b:.3f}" if a is not None and b else "")
                body.append(row)
            parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths], body))

    pk = _passkey_cells(rows)
    if pk:
        lengths = sorted({k[2] for k in pk})
        depths = sorted({r["depth"] for r in rows if r["task"] == "passkey"})
        parts.append(f"\n## Passkey retrieval (teacher-forced), correct / trials over depths "
                     f"{', '.join(f'{d:g}' for d in depths)}\n")
        keys = [(m, s) for m in methods for s in stages if any((m, s, L) in pk for L in lengths)]
        body = [[m, s] + [f"{pk[(m, s, L)][0]}/{pk[(m, s, L)][1]}" if (m, s, L) in pk else ""
                          for L in lengths] for m, s in keys]
        parts.append(markdown_table(["method", "stage"] + [str(L) for L in lengths], body))
        cell = {(r["method"], r["stage"], r["depth"], r["length"]): r for r in rows
                if r["task"] == "passkey"}
        parts.append("\nBy needle depth (correct / trials):\n")
        body = [[m, s, f"{d:g}"] + [f"{cell[(m, s, d, L)]['correct']}/{cell[(m, s, d, L)]['n']}"
                                    if (m, s, d, L) in cell else "" for L in lengths]
                for m, s in keys for d in depths]
        parts.append(markdown_table(["method", "stage", "depth"] + [str(L) for L in lengths],
                                    body))

    ft = [r for r in rows if r["task"] == "finetune"]
    if ft:
        ref_step = next((r["value"] for r in ft if r["method"] == ref), None)
        parts.append("\n## Fine-tune (hf_hilbert_attn.tools.finetune, one process; s/step and tokens/s "
                     "exclude the first step)\n")
        body = [[r["method"], r["n"], r["length"], r["value"], r["tokens_per_s"],
                 f"{r['value'] / ref_step:.3f}" if ref_step else "", r["final_loss"],
                 r["peak_mem_mb"] / 1024 if r["peak_mem_mb"] != "" else "", r["seconds"]]
                for r in ft]
        parts.append(markdown_table(["method", "steps", "seq len", "s/step", "tokens/s",
                                     f"step time / {ref or 'sdpa'}'s", "loss (last 10 steps)",
                                     "peak GiB", "wall s"], body))

    wall: "OrderedDict[Tuple[str, str], float]" = OrderedDict()
    seen = set()
    for r in rows:  # a passkey cell's seconds are repeated on each of its depth rows
        cell = (r["method"], r["stage"], r["task"], r["length"])
        if r["task"] in TASKS and cell not in seen:
            seen.add(cell)
            wall[cell[:2]] = wall.get(cell[:2], 0.0) + r["seconds"]
    if wall:
        parts.append("\n## Eval wall time (seconds; model loading excluded)\n")
        parts.append(markdown_table(["method", "stage", "seconds"],
                                    [[m, s, v] for (m, s), v in wall.items()]))
    if errors:
        parts.append("\n## Failed\n\n" + "\n".join(f"- {e}" for e in errors))
    return "\n".join(parts) + "\n"


def _colors(methods, ref):
    """Black for the dense control; tab10 without its grey (grey draws the stage legend)."""
    import matplotlib

    if len(methods) <= 10:
        palette = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
    else:
        palette = [c for i, c in enumerate(matplotlib.colormaps["tab20"].colors)
                   if i not in (14, 15)]
    out, i = {}, 0
    for m in methods:
        if m == ref:
            out[m] = "black"
        else:
            out[m] = palette[i % len(palette)]
            i += 1
    return out


def _length_label(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def plot_quality_perplexity(rows: Sequence[Dict], path) -> Optional[Path]:
    """Perplexity (left) and its ratio to dense sdpa (right) vs context length; one colour per
    method, base solid, finetuned dashed, the dense control black and thick; log2 x axis."""
    ppl = [r for r in rows if r["task"] == "perplexity"]
    if not ppl:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D

    ref = _reference(rows)
    methods = _ordered(r["method"] for r in ppl)
    colors = _colors(methods, ref)
    val = {(r["method"], r["stage"], r["length"]): r["value"] for r in ppl}
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=(13 if ref else 7.5, 5.0), squeeze=False)
    for stage, style in (("base", "-"), ("finetuned", "--")):
        for m in methods:
            pts = sorted((L, v) for (mm, s, L), v in val.items() if mm == m and s == stage)
            if not pts:
                continue
            kw = dict(color=colors[m], linestyle=style, marker="o",
                      linewidth=3.0 if m == ref else 1.5, markersize=4, zorder=3 if m == ref else 2)
            axes[0][0].plot([p[0] for p in pts], [p[1] for p in pts], **kw)
            if ref:
                rp = [(L, v / val[(ref, stage, L)]) for L, v in pts if (ref, stage, L) in val]
                if rp:
                    axes[0][1].plot([p[0] for p in rp], [p[1] for p in rp], **kw)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax = axes[0][0]  # log y: a pattern at 4x dense must not flatten the dense curves
    ax.set_yscale("log")
    spread = max(val.values()) / max(min(val.values()), 1e-9)
    subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if spread > 4 else (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5,
                                                              3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("held-out perplexity")
    if ref:
        axes[0][1].axhline(1.0, color="grey", linewidth=0.8)
        axes[0][1].set_ylabel(f"perplexity / {ref}'s (same stage)")
        axes[0][1].set_title(f"ratio to dense {ref}")
    lengths = sorted({r["length"] for r in ppl})
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(L) for L in lengths])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colors[m], linewidth=3.0 if m == ref else 1.5, label=m)
               for m in methods]
    handles += [Line2D([], [], color="grey", linestyle="-", label="base"),
                Line2D([], [], color="grey", linestyle="--", label="finetuned")]
    axes[0][-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       fontsize=8, frameon=False)
    fig.suptitle("Perplexity vs context length: dilated patterns against dense attention")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_quality_passkey(rows: Sequence[Dict], path) -> Optional[Path]:
    """Passkey accuracy heat maps (method × length, mean over depths), one panel per stage."""
    pk = _passkey_cells(rows)
    if not pk:
        return None
    plt = _plt()
    methods = _ordered(r["method"] for r in rows if r["task"] == "passkey")
    stages = [s for s in STAGES if any(k[1] == s for k in pk)]
    lengths = sorted({k[2] for k in pk})
    fig, axes = plt.subplots(1, len(stages), squeeze=False,
                             figsize=(2.6 + 0.9 * len(lengths) * len(stages),
                                      1.4 + 0.38 * len(methods)))
    im = None
    for col, (ax, stage) in enumerate(zip(axes[0], stages)):
        grid = [[pk[(m, stage, L)][0] / pk[(m, stage, L)][1] if (m, stage, L) in pk
                 else float("nan") for L in lengths] for m in methods]
        im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for i, m in enumerate(methods):
            for j, L in enumerate(lengths):
                c = pk.get((m, stage, L))
                ax.text(j, i, f"{c[0]}/{c[1]}" if c else "-", ha="center", va="center",
                        fontsize=7)
        ax.set_xticks(range(len(lengths)), [_length_label(L) for L in lengths])
        ax.set_yticks(range(len(methods)), methods if col == 0 else [""] * len(methods))
        ax.set_xlabel("context length")
        ax.set_title(stage)
    fig.colorbar(im, ax=list(axes[0]), label="accuracy (all depths)")
    fig.suptitle("Passkey retrieval (teacher-forced)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write_quality_report(out_dir, *, plots: bool = True, errors: Sequence[str] = (),
                         missing_ok: bool = False) -> Dict:
    """Redraw ``quality.md``, ``quality_ppl.png`` and ``quality_passkey.png`` from
    ``OUT/quality.csv`` (and ``OUT/study.json`` for the settings line).

    Returns:
        ``{"markdown": str, "files": {name: Path}}``.

    Raises:
        StudyError: ``OUT/quality.csv`` does not exist (unless ``missing_ok``: no rows yet).
    """
    out = Path(out_dir)
    csv_path = out / "quality.csv"
    if not csv_path.is_file() and not missing_ok:
        raise StudyError(f"no results to report: {csv_path} not found")
    rows = read_rows(csv_path) if csv_path.is_file() else []
    meta = out / "study.json"
    settings = json.loads(meta.read_text())["settings"] if meta.is_file() else None
    md = quality_markdown(rows, settings, errors)
    (out / "quality.md").write_text(md)
    files = {"csv": csv_path} if rows else {}
    files["markdown"] = out / "quality.md"
    if plots:
        p = plot_quality_perplexity(rows, out / "quality_ppl.png")
        if p:
            files["ppl_png"] = p
        p = plot_quality_passkey(rows, out / "quality_passkey.png")
        if p:
            files["passkey_png"] = p
    return {"markdown": md, "files": files}


# ----------------------------------------------------------------------------- command line
def add_quality_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _len = length_type("context length")
    p.add_argument("--model", help="local Hugging Face causal LM directory (with its tokenizer)")
    p.add_argument("--corpus", help="directory with train/ and heldout/ of .txt files (each file "
                                    "one document)")
    p.add_argument("--methods", default=str(DEFAULT_METHODS),
                   help="YAML list of methods: label, attn_implementation (sdpa | "
                        "hilbert_dilated), pattern (configs/ name, YAML path or inline dict); "
                        "default: the packaged quality_study.yaml")
    p.add_argument("--methods-filter", nargs="+", default=[], metavar="LABEL",
                   help="run only these labels (shell globs, e.g. 'seg*' sdpa)")
    p.add_argument("--out", default=results_dir("quality"), help="output directory (default %(default)s)")
    p.add_argument("--lengths", nargs="+", type=_len, default=[1024, 2048, 4096, 8192],
                   help="perplexity context lengths (default 1k 2k 4k 8k; 16k 32k accepted)")
    p.add_argument("--ppl-tokens", type=positive_int, default=65536,
                   help="held-out tokens scored at every length (default 65536, or all there are)")
    p.add_argument("--passkey-lengths", nargs="+", type=_len, default=[1024, 2048, 4096, 8192])
    p.add_argument("--depths", nargs="+", type=depth, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=positive_int, default=6, help="passkey prompts per depth")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--stages", nargs="+", choices=STAGES, default=None,
                   help="default: base, plus finetuned when --finetune-steps > 0 "
                        "(--stages finetuned skips the base eval)")
    p.add_argument("--finetune-steps", type=nonneg_int, default=0,
                   help="fine-tune steps per method (0: no fine-tune)")
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-warmup", type=nonneg_int, default=10, help="linear warm-up steps")
    p.add_argument("--finetune-seq-len", type=_len, default=8192)
    p.add_argument("--finetune-args", default="",
                   help="more arguments for hf_hilbert_attn.tools.finetune, one string "
                        "(e.g. '--gradient-checkpointing --loss-chunk 4096')")
    p.add_argument("--batch-tokens", type=positive_int, default=65536,
                   help="tokens per eval forward (windows / passkey prompts batched up to it)")
    p.add_argument("--dtype", default="auto",
                   choices=("auto", "autocast-bf16", "float32", "bfloat16", "float16"),
                   help="auto: fp32 weights + bf16 autocast on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true",
                   help="discard OUT/quality.csv instead of resuming from it")
    p.add_argument("--report-only", metavar="OUT", default=None,
                   help="only redraw quality.md and the PNGs from OUT/quality.csv")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> QualityConfig:
    return QualityConfig(
        model=args.model or "", corpus=args.corpus or "", methods=args.methods,
        methods_filter=tuple(args.methods_filter), out=args.out, lengths=tuple(args.lengths),
        ppl_tokens=args.ppl_tokens, passkey_lengths=tuple(args.passkey_lengths),
        depths=tuple(args.depths), trials=args.trials, tasks=tuple(args.tasks),
        stages=tuple(args.stages or ()), finetune_steps=args.finetune_steps,
        finetune_lr=args.finetune_lr, finetune_warmup=args.finetune_warmup,
        finetune_seq_len=args.finetune_seq_len, finetune_args=args.finetune_args,
        batch_tokens=args.batch_tokens, dtype=args.dtype, device=args.device, seed=args.seed,
        fresh=args.fresh, plots=not args.no_plots, progress=not args.no_progress)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Bad inputs exit 2 with one line (``parser.error``); a method failing at run time is
    reported in quality.md and gives exit status 1 after the others ran."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # `timeout` sends SIGTERM: leave through SystemExit so a running fine-tune subprocess is
    # killed with us (see _finetune) instead of holding the GPU after we are gone
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.report_only:
            res = write_quality_report(args.report_only, plots=not args.no_plots)
        else:
            res = run_quality_study(config_from_args(args))
    except StudyError as e:
        parser.error(str(e))
    print(res["markdown"])
    print(f"wrote {', '.join(str(v) for v in res['files'].values())}")
    return 1 if res.get("errors") else 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_quality_arguments(argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0]))
    return run_from_args(parser.parse_args(argv), parser)
