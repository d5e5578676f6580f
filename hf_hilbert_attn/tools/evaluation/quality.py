"""Quality of dilated patterns on a real model: perplexity and passkey retrieval against dense
``sdpa`` on the same held-out text, before and after the same short fine-tune.

    hf-hilbert-attn quality --model smollm2 --corpus shakespeare \\
        --finetune-steps 150 --out quality_results

For every method of the methods file (``sdpa``, or ``hilbert_dilated`` with a pattern) and every
stage (``base``: the model as given; ``finetuned``: after ``hf_hilbert_attn.tools.finetune``
(``examples/finetune.py``) ran on ``CORPUS/train`` with the same data order, steps, learning rate and seed for every method, the
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

The methods file, the corpus and the CSV rows: :mod:`.quality_data`; the tables and plots:
:mod:`.quality_report`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import hf_hilbert_attn
from hf_hilbert_attn.pattern import DilatedPattern

# the options live with the console command, which must not import torch to parse them
from ..options import add_quality_arguments
from ._args import InputError, check_device, check_eval_grid, results_dir
from .corpus import tokenize_corpus
from .measure import Meter
from .passkey import check_prompt_fits, evaluate_passkey_teacher_forced
from .perplexity import perplexity_batched
from .quality_data import (STAGES, TASKS, QualityMethod, StudyError, _cell_key, _row, append_rows,
                           filter_methods, load_methods, read_documents, read_rows)
from .quality_report import write_quality_report

logger = logging.getLogger(__name__)

__all__ = ["QualityMethod", "QualityConfig", "load_methods", "read_documents", "pattern_density",
           "perplexity_batched", "run_quality_study", "write_quality_report",
           "add_quality_arguments", "main"]

# the fine-tune subprocess imports the package from here
PACKAGE_PARENT = Path(hf_hilbert_attn.__file__).resolve().parents[1]
DEFAULT_METHODS = Path(__file__).with_name("quality_study.yaml")  # installed with the package
# Settings that change the numbers: a resumed run must use the same ones.
_VALUE_SETTINGS = ("model", "corpus", "ppl_tokens", "depths", "trials", "seed", "dtype",
                   "finetune_steps", "finetune_lr", "finetune_warmup", "finetune_seq_len",
                   "finetune_args")


# ----------------------------------------------------------------------------- measurements
_DENSITY: Dict[Tuple, float] = {}


def pattern_density(pattern: Optional[DilatedPattern], length: int, num_heads: int,
                    device=None, num_kv_heads: Optional[int] = None) -> float:
    """Allowed causal pairs / dense causal pairs at ``length``, over ``num_heads`` query heads
    (1.0 for ``None``, i.e. sdpa); exact (:meth:`DilatedPattern.count_pairs_total`; a pattern
    with dense heads needs ``num_kv_heads`` to map query heads to them)."""
    if pattern is None or pattern.is_dense_for(length):
        return 1.0
    key = (pattern, int(length), int(num_heads), num_kv_heads)
    if key not in _DENSITY:
        pairs = pattern.count_pairs_total(length, num_heads, num_kv_heads=num_kv_heads)
        _DENSITY[key] = pairs / (num_heads * length * (length + 1) / 2)
    return _DENSITY[key]


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
    finetune_args: str = ""  # more arguments for tools.finetune, e.g. "--loss-chunk 4096"
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
            density = pattern_density(method.pattern, L, heads, study.device,
                                      getattr(model.config, "num_key_value_heads", None) or heads)
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
    """Fine-tune ``method`` from the base weights with ``hf_hilbert_attn.tools.finetune`` (one
    process); returns ``OUT/finetune/<label>/final`` and records the step time and tokens/s."""
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
    cmd = [sys.executable, "-m", "hf_hilbert_attn.tools.finetune",
           "--model", str(Path(cfg.model).resolve()),
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
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..progress import progress_bar

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
        # a bar on a terminal, else a line per block and at most one every few seconds
        with progress_bar(total=total, desc="quality", unit="cells", disable=not cfg.progress,
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


# ----------------------------------------------------------------------------- command line
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
    tuned = Path(args.report_only or args.out) / "finetune"
    if tuned.is_dir():  # (a model per fine-tuned method: often the most disk of the study)
        print(f"fine-tuned models: {tuned}/<label>/final (delete them when done)")
    return 1 if res.get("errors") else 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_quality_arguments(argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0]))
    return run_from_args(parser.parse_args(argv), parser)
