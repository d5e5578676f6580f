"""The long-context eval: perplexity vs context length, passkey retrieval, tokens/s and memory,
for ``sdpa`` and ``hilbert_dilated`` with one or more patterns. Command-line entry points:
``hf-hilbert-attn eval`` and ``examples/eval_long_context.py`` (both call :func:`main`)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from hf_hilbert_attn.pattern import DilatedPattern

# the options live with the console command, which must not import torch to parse them
from ..options import EVAL_TASKS, add_eval_arguments
from ..progress import progress_bar, stage
from . import report
from ._args import (InputError, InputNotFound, check_device, check_eval_grid,
                    quiet_libraries_if_redirected, report_input_errors, resolve_pattern,
                    results_dir)
from .corpus import build_char_tokenizer, build_default_model, load_corpus, tokenize_corpus
from .measure import Meter
from .passkey import check_prompt_fits, evaluate_passkey, hf_generate_fn
from .perplexity import count_windows, evaluate_perplexity

logger = logging.getLogger(__name__)

__all__ = ["EvalConfig", "Method", "resolve_pattern", "run_eval", "add_eval_arguments",
           "config_from_args", "main"]

@dataclass(frozen=True)
class Method:
    """One attention implementation to evaluate (and its pattern, for hilbert_dilated)."""

    attn_implementation: str
    pattern_label: str = ""
    pattern: Optional[DilatedPattern] = None

    @property
    def label(self) -> str:
        return self.attn_implementation + (f":{self.pattern_label}" if self.pattern_label else "")


BUILTIN_RULER_LENGTHS = (512,)  # the built-in model's prompt lengths for --tasks ruler


@dataclass
class EvalConfig:
    """What to evaluate; the defaults are the built-in CPU run (``model=None``)."""

    model: Optional[str] = None
    patterns: Sequence[str] = ()
    include_sdpa: bool = True
    tasks: Sequence[str] = ("perplexity", "passkey")
    lengths: Sequence[int] = ()
    stride: Optional[int] = None  # tokens; default length // 2
    ppl_tokens: Optional[int] = None  # default 4 × the longest length
    corpus: Sequence[str] = ()
    text_field: str = "text"
    passkey_lengths: Sequence[int] = ()
    depths: Sequence[float] = (0.0, 0.5, 1.0)
    trials: int = 2
    max_new_tokens: int = 8
    device: str = "auto"
    dtype: str = "auto"
    out_dir: Optional[str] = None  # default: hf_hilbert_results/eval/<the model folder's name>
    sp_size: int = 1
    seed: int = 0
    plots: bool = True
    progress: bool = True
    fresh: bool = False  # discard out_dir's results.csv instead of resuming from it

    def resolved(self) -> "EvalConfig":
        builtin = self.model is None
        c = EvalConfig(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        if not c.patterns:
            c.patterns = ("dense", "tiny") if builtin else ("default",)
        given = bool(c.lengths)
        if not c.lengths:
            c.lengths = (128, 256, 512) if builtin else (2048, 4096, 8192, 16384)
        c.lengths = tuple(sorted(int(x) for x in c.lengths))
        if not c.passkey_lengths:
            # the RULER tasks' fixed parts take up to 372 characters of the built-in tokenizer:
            # its default prompts are 512 tokens long then (BUILTIN_RULER_LENGTHS)
            c.passkey_lengths = (BUILTIN_RULER_LENGTHS if builtin and not given
                                 and "ruler" in c.tasks else c.lengths)
        if c.ppl_tokens is None:
            c.ppl_tokens = 4 * max(c.lengths)
        if c.out_dir is None:  # a folder per model: another model's eval never meets its results
            name = Path(c.model).resolve().name if c.model else "builtin"
            c.out_dir = f"{results_dir('eval')}/{name}"
        return c


# ----------------------------------------------------------------------------- model loading
def _device_and_dtype(cfg: EvalConfig):
    if cfg.device == "auto" and torch.cuda.is_available():
        # one GPU per process under torchrun / accelerate launch
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    elif cfg.device == "auto":
        device = torch.device("cpu")
    else:
        device = torch.device(cfg.device)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def load_tokenizer(cfg: EvalConfig):
    if cfg.model is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(cfg.model)
    except (OSError, ValueError) as e:  # no tokenizer files, or none this install can read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{cfg.model}: no usable tokenizer ({first})") from None


def load_model(cfg: EvalConfig, method: Method, tokenizer, device, dtype):
    """The model of ``cfg`` with ``method``'s attention (and pattern), on ``device`` in ``dtype``."""
    if cfg.model is None:
        model = build_default_model(tokenizer, seed=cfg.seed)
        if method.attn_implementation != "sdpa":
            model.set_attn_implementation(method.attn_implementation)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            cfg.model, attn_implementation=method.attn_implementation, dtype=dtype)
    if method.pattern is not None:
        import hf_hilbert_attn

        hf_hilbert_attn.configure(model, method.pattern)
    return model.to(device=device, dtype=dtype).eval()


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sequence parallel
def _sp_window_nll(model, ids: torch.Tensor, num_scored: int, topo, pattern) -> float:
    """Summed NLL of one window with its sequence sharded over the SP group (ring attention).

    ``shard_for_sequence_parallel`` shards ``input_ids`` and the (unshifted) labels, which are
    -100 on unscored tokens, and returns this shard's already shifted ``shift_labels``; every
    rank sums its shard's NLL and the sums are all-reduced over the group.
    """
    import hf_hilbert_attn
    from hf_hilbert_attn.integrations.accelerate import shard_for_sequence_parallel

    L = ids.shape[1]
    labels = ids.clone()
    labels[0, :L - num_scored] = -100
    shard = shard_for_sequence_parallel({"input_ids": ids, "labels": labels}, topo,
                                        pattern=pattern)
    with hf_hilbert_attn.sequence_parallel(topo.group), torch.inference_mode():
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), shard["shift_labels"].flatten().to(logits.device),
            ignore_index=-100, reduction="sum")
    torch.distributed.all_reduce(nll, group=topo.group)
    return float(nll)


# ----------------------------------------------------------------------------- the eval
def build_methods(cfg: EvalConfig) -> List[Method]:
    """The methods to run: sdpa (unless excluded), then one per pattern."""
    methods = [Method("sdpa")] if cfg.include_sdpa else []
    return methods + [Method("hilbert_dilated", *resolve_pattern(p)) for p in cfg.patterns]


def run_eval(cfg: EvalConfig) -> Dict:
    """Run the eval of ``cfg`` and write its results into ``cfg.out_dir``.

    ``results.csv`` is rewritten after every finished cell (a method at one length of one
    task), beside ``eval_settings.json``; a later run into the same directory with the same
    settings resumes: it keeps those rows and runs only the missing cells (``cfg.fresh``
    starts over).

    Returns:
        A dict: ``rows`` (one per cell, per needle depth for passkey: the rows of
        ``results.csv``), ``files`` (name → path), ``markdown`` (the printed tables), ``notes``.

    Raises:
        InputError (a ``ValueError``; ``InputNotFound`` is also a ``FileNotFoundError``): bad
            lengths, depths, patterns, device, corpus files, a corpus shorter than the longest
            length, or an output directory holding results of other settings.
    """
    cfg = cfg.resolved()
    _validate(cfg)
    tokenizer = load_tokenizer(cfg)
    check_prompts(cfg, tokenizer)
    return _run_eval(cfg, tokenizer)


def check_prompts(cfg: EvalConfig, tokenizer) -> None:
    """Every passkey / RULER prompt of ``cfg`` (resolved) can be built with ``tokenizer``:
    checked before any model is built; :class:`InputError` naming the length needed."""
    if "passkey" in cfg.tasks:  # the shortest prompt must fit
        check_prompt_fits(tokenizer, min(cfg.passkey_lengths), InputError)
    if "ruler" in cfg.tasks:
        from .ruler import TASKS, check_lengths

        option = "--passkey-lengths" if cfg.passkey_lengths != cfg.lengths else "--lengths"
        check_lengths(tokenizer, cfg.passkey_lengths, tasks=TASKS, depths=cfg.depths,
                      trials=cfg.trials, seed=cfg.seed, error=InputError,
                      what=f"--tasks ruler: {option}")


def _run_eval(cfg: EvalConfig, tokenizer) -> Dict:
    """:func:`run_eval` once ``cfg`` (resolved) is checked and its tokenizer loaded."""
    device, dtype = _device_and_dtype(cfg)
    methods = build_methods(cfg)
    if not methods:
        raise InputError("nothing to evaluate: --no-sdpa and no --pattern")
    notes: List[str] = []
    topo, rank = _topology(cfg, device, notes)
    tokens = _perplexity_tokens(cfg, tokenizer) if "perplexity" in cfg.tasks else None
    model_name = cfg.model or "builtin-tiny-llama"
    common = dict(model=model_name, device=str(device), dtype=str(dtype).replace("torch.", ""))
    disable = not cfg.progress or rank != 0  # bars on a terminal, else lines (..progress)
    results = _Results(Path(cfg.out_dir), _settings(cfg, methods, common), fresh=cfg.fresh,
                       writer=rank == 0)
    if topo is not None:  # every rank has read the old rows before rank 0 writes new ones
        torch.distributed.barrier(group=topo.group)
    if results.rows:
        notes.append(f"resumed: {len(results.done)} cell(s) read from {results.csv}")
        logger.info("resuming in %s: %d finished cell(s) kept", cfg.out_dir, len(results.done))

    ruler_rows: List[Dict] = []
    plan = [(method, [(t, L) for t in ("perplexity", "passkey") if t in cfg.tasks
                      for L in (cfg.lengths if t == "perplexity" else cfg.passkey_lengths)
                      if (method.label, t, L) not in results.done]) for method in methods]
    plan = [(m, todo) for m, todo in plan if todo or "ruler" in cfg.tasks]
    n_cells = sum(len(todo) + ("ruler" in cfg.tasks) for _, todo in plan)
    cell = 0
    for i, (method, todo) in enumerate(plan):
        stage(f"eval: method {i + 1}/{len(plan)} {method.label}: loading "
              f"{cfg.model or 'the built-in model'}", enabled=not disable)
        model = load_model(cfg, method, tokenizer, device, dtype)
        if "ruler" in cfg.tasks:
            cell += 1
            if rank == 0:
                _ruler(model, tokenizer, cfg, method, Path(cfg.out_dir), ruler_rows, disable,
                       f"[{cell}/{n_cells}]")
        for task, L in todo:
            cell += 1
            where = f"[{cell}/{n_cells}]"
            if task == "perplexity":
                results.add(_perplexity_cell(model, method, L, tokens, cfg, topo, common, device,
                                             disable, where))
            else:
                results.add(_passkey_cell(model, tokenizer, method, L, cfg, common, device,
                                          disable, where))
        del model
        _free(device)

    # the table in the order of this run's methods and lengths, whatever order the cells ran in
    order = {(m.label, t, L): i for i, (m, t, L) in enumerate(
        (m, t, L) for m in methods for t in ("perplexity", "passkey")
        for L in (cfg.lengths if t == "perplexity" else cfg.passkey_lengths))}
    rows = sorted((r for r in results.rows if (r["method"], r["task"], r["length"]) in order),
                  key=lambda r: order[(r["method"], r["task"], r["length"])])
    if rank != 0:  # rank 0 writes the results of a sequence-parallel run
        return {"markdown": "", "files": {}, "notes": notes, "rows": rows}
    out = report.write_eval_report(rows, cfg.out_dir, notes=notes, plots=cfg.plots,
                                   title=f"{model_name} on {device.type} ({common['dtype']})")
    out["files"]["settings"] = results.settings_path
    if ruler_rows:  # (its table printed and in results.md too; per prompt: ruler.csv)
        out["files"].update(_ruler_files(ruler_rows, cfg, model_name))
        out["markdown"] += _ruler_markdown(ruler_rows)
        out["files"]["markdown"].write_text(out["markdown"])
    out["notes"] = notes
    out["rows"] = rows
    return out


def _topology(cfg: EvalConfig, device, notes: List[str]):
    """``(sequence-parallel topology or None, rank)``: a group only with ``sp_size > 1``."""
    if cfg.sp_size <= 1:
        return None, 0
    _init_distributed(device)
    if not torch.distributed.is_initialized():
        raise InputError(f"--sp-size {cfg.sp_size} needs a process group: start the eval "
                         f"with `torchrun --nproc_per_node N` or `accelerate launch --multi_gpu "
                         f"--num_processes N` (the flag also on CPUs)")
    from hf_hilbert_attn.integrations.accelerate import sequence_parallel_topology

    world = torch.distributed.get_world_size()
    if world % cfg.sp_size:  # (every rank says so in one line, not a traceback)
        raise InputError(f"--sp-size {cfg.sp_size} must divide the number of processes ({world})")
    topo = sequence_parallel_topology(None, cfg.sp_size)
    notes.append(f"hilbert_dilated perplexity windows sharded over {cfg.sp_size} ranks (ring "
                 f"attention); sdpa and passkey (generate) run unsharded on every rank")
    return topo, torch.distributed.get_rank()


def _perplexity_tokens(cfg: EvalConfig, tokenizer) -> torch.Tensor:
    """The held-out token stream; it must hold the longest context length."""
    try:
        docs = load_corpus(cfg.corpus, text_field=cfg.text_field,
                           num_chars=max(200_000, 2 * cfg.ppl_tokens))
    except FileNotFoundError as e:
        raise InputNotFound(str(e)) from None
    except ValueError as e:
        raise InputError(str(e)) from None
    tokens = tokenize_corpus(tokenizer, docs, cfg.ppl_tokens)
    if tokens.numel() < max(cfg.lengths):
        raise InputError(f"the corpus has {tokens.numel()} tokens, fewer than the longest "
                         f"context length {max(cfg.lengths)}: give more text (--corpus) or "
                         f"shorter --lengths")
    return tokens


def _perplexity_cell(model, method, L: int, tokens, cfg: EvalConfig, topo, common: Dict, device,
                     disable: bool, where: str = "") -> List[Dict]:
    stride = cfg.stride or max(1, L // 2)
    n_win = count_windows(int(tokens.numel()), L, stride)
    with progress_bar(total=n_win, desc=f"eval {where} {method.label} perplexity L={L}",
                      unit="windows", disable=disable,
                      leave=False) as bar, Meter(device) as m:
        if topo is None or method.pattern is None:
            res = evaluate_perplexity(model, tokens, L, stride, progress=bar)
        else:
            res = _sp_perplexity(model, tokens, L, stride, topo, method.pattern, bar)
    return [dict(common, method=method.label, task="perplexity", length=L,
                 depth="", value=res.perplexity, stride=stride,
                 scored_tokens=res.scored_tokens,
                 processed_tokens=res.processed_tokens, seconds=m.seconds,
                 tokens_per_s=res.processed_tokens / max(m.seconds, 1e-9),
                 peak_mem_mb=m.peak_bytes / 2**20, mem_kind=m.kind)]


def _passkey_cell(model, tokenizer, method, L: int, cfg: EvalConfig, common: Dict, device,
                  disable: bool, where: str = "") -> List[Dict]:
    gen = hf_generate_fn(model, tokenizer, cfg.max_new_tokens)
    with progress_bar(total=len(cfg.depths) * cfg.trials,
                      desc=f"eval {where} {method.label} passkey L={L}", unit="prompts",
                      disable=disable, leave=False) as bar, Meter(device) as m:
        res = evaluate_passkey(gen, tokenizer, L, cfg.depths, cfg.trials,
                               seed=cfg.seed, progress=bar)
    total_tokens = sum(r["prompt_tokens"] for r in res)
    return [dict(common, method=method.label, task="passkey", length=L,
                 depth=r["depth"], value=r["accuracy"], stride="",
                 scored_tokens=r["trials"], processed_tokens=r["prompt_tokens"],
                 seconds=m.seconds,
                 tokens_per_s=total_tokens / max(m.seconds, 1e-9),
                 peak_mem_mb=m.peak_bytes / 2**20, mem_kind=m.kind,
                 answers=" | ".join(a.replace("\n", " ") for a in r["answers"]))
            for r in res]


def _ruler_files(ruler_rows: List[Dict], cfg: EvalConfig, model_name: str) -> Dict[str, Path]:
    """``ruler.csv`` and, with plots, heat maps per method."""
    from .ruler_report import plot_ruler, write_ruler_csv

    files = {"ruler": write_ruler_csv(ruler_rows, Path(cfg.out_dir) / "ruler.csv",
                                      extra=("method",))}
    for label in dict.fromkeys(r["method"] for r in ruler_rows) if cfg.plots else ():
        mine = [r for r in ruler_rows if r["method"] == label]
        folder = Path(cfg.out_dir) / "ruler" / re.sub(r"[^\w.-]+", "_", label)
        for path in plot_ruler(mine, folder, title=f"{model_name}, {label}"):
            files[f"{path.stem}_{label}"] = path
    return files


def _ruler_markdown(ruler_rows: List[Dict]) -> str:
    """The RULER-style tasks' mean score per method, task and prompt length."""
    from .report import markdown_table
    from .ruler_report import summarize

    body = [[g["method"], g["task"], g["length"], g["score"], g["n"]]
            for g in summarize(ruler_rows, by=("method", "task", "length"))]
    return ("\n\n## RULER-style tasks (mean score per method, task and length)\n\n"
            + markdown_table(["method", "task", "length", "score", "prompts"], body) + "\n")


# Settings that change the numbers: a resumed eval must use the same ones.
_VALUE_SETTINGS = ("model", "corpus", "text_field", "ppl_tokens", "stride", "depths", "trials",
                   "max_new_tokens", "seed", "device", "dtype", "sp_size")


def _settings(cfg: EvalConfig, methods: Sequence[Method], common: Dict) -> Dict:
    return dict(
        model=str(Path(cfg.model).resolve()) if cfg.model else None,
        corpus=[str(Path(c).resolve()) for c in cfg.corpus], text_field=cfg.text_field,
        ppl_tokens=int(cfg.ppl_tokens), stride=cfg.stride, depths=[float(d) for d in cfg.depths],
        trials=int(cfg.trials), max_new_tokens=int(cfg.max_new_tokens), seed=int(cfg.seed),
        device=torch.device(common["device"]).type, dtype=common["dtype"],
        sp_size=int(cfg.sp_size),
        methods={m.label: (m.pattern.to_dict() if m.pattern is not None else None)
                 for m in methods})


class _Results:
    """``OUT/results.csv`` kept current cell by cell, and the cells a previous run finished."""

    def __init__(self, out: Path, settings: Dict, *, fresh: bool, writer: bool):
        self.out, self.settings, self.writer = out, settings, writer
        self.csv, self.settings_path = out / "results.csv", out / "eval_settings.json"
        self.rows: List[Dict] = []
        if fresh:
            if writer:
                for f in (self.csv, self.settings_path):
                    f.unlink(missing_ok=True)
        elif self.csv.exists():
            self.rows = self._previous()
        if writer:
            out.mkdir(parents=True, exist_ok=True)
            old = (json.loads(self.settings_path.read_text())
                   if self.rows and self.settings_path.exists() else {"methods": {}})
            settings = dict(settings, methods=dict(old["methods"], **settings["methods"]))
            self.settings_path.write_text(json.dumps(settings, indent=1) + "\n")

    @property
    def done(self) -> set:
        return {(r["method"], r["task"], r["length"]) for r in self.rows}

    def _previous(self) -> List[Dict]:
        if not self.settings_path.exists():
            raise InputError(f"{self.out} has a results.csv but no eval_settings.json (an "
                             f"older run?): use --fresh (fresh=True) to start over, or another "
                             f"--out-dir (out_dir=)")
        old = json.loads(self.settings_path.read_text())
        diff = [f"{k}: {old.get(k)!r} -> {self.settings[k]!r}" for k in _VALUE_SETTINGS
                if old.get(k) != self.settings[k]]
        diff += [f"the pattern of {label}" for label, pat in self.settings["methods"].items()
                 if label in old.get("methods", {}) and old["methods"][label] != pat]
        if diff:
            raise InputError(f"{self.out} holds results of other settings ({'; '.join(diff)}): "
                             f"use --fresh (fresh=True) to start over, or another --out-dir "
                             f"(out_dir=)")
        return report.read_eval_csv(self.csv)

    def add(self, rows: List[Dict]) -> None:
        self.rows.extend(rows)
        if self.writer:  # the whole file, renamed into place: a run stopped now keeps every
            tmp = report.write_csv(self.rows, self.csv.with_suffix(".csv.tmp"))  # finished cell
            os.replace(tmp, self.csv)


def _init_distributed(device) -> None:
    """Join the process group that ``torchrun`` / ``accelerate launch`` describe in the
    environment (NCCL on CUDA, gloo on CPU), unless one exists already."""
    dist = torch.distributed
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)


def _sp_perplexity(model, tokens, L, stride, topo, pattern, bar):
    from .perplexity import PerplexityResult, strided_windows

    device = next(model.parameters()).device
    nll, scored_total, processed, windows = 0.0, 0, 0, 0
    for begin, end, scored in strided_windows(int(tokens.numel()), L, stride):
        nll += _sp_window_nll(model, tokens[begin:end].unsqueeze(0).to(device), scored, topo,
                              pattern)
        scored_total += scored
        processed += end - begin
        windows += 1
        bar.update(1)
    return PerplexityResult(L, stride, nll, scored_total, processed, windows)


def _ruler(model, tokenizer, cfg: EvalConfig, method, results_dir: Path, rows: List[Dict],
           disable: bool, where: str = "") -> None:
    """The RULER-style tasks of one method (``--tasks ruler``): one row per prompt into ``rows``
    (written with the heat maps once every method ran)."""
    from .ruler import TASKS, evaluate_ruler

    n = len(TASKS) * len(cfg.passkey_lengths) * len(cfg.depths) * cfg.trials
    with progress_bar(total=n, desc=f"eval {where} {method.label} ruler", unit="prompts",
                      disable=disable, leave=False) as bar:
        res = evaluate_ruler(model, tokenizer, lengths=cfg.passkey_lengths, depths=cfg.depths,
                             trials=cfg.trials, seed=cfg.seed, progress=bar)
    rows += [dict(r, method=method.label) for r in res]


def _validate(cfg: EvalConfig) -> None:
    check_eval_grid(cfg.tasks, EVAL_TASKS, cfg.lengths, cfg.passkey_lengths,
                    cfg.depths, cfg.trials, error=InputError)
    if cfg.stride is not None and cfg.stride < 1:
        raise InputError(f"stride must be >= 1, got {cfg.stride}")
    if cfg.stride is not None and cfg.stride >= min(cfg.lengths):
        raise InputError(f"stride must be < every length (shortest {min(cfg.lengths)}), "
                         f"got {cfg.stride}")
    if cfg.ppl_tokens < 2:
        raise InputError(f"ppl_tokens must be >= 2, got {cfg.ppl_tokens}")
    if cfg.plots:  # missing, one line before any model runs, not after every cell
        import matplotlib  # noqa: F401
    if "perplexity" in cfg.tasks and cfg.ppl_tokens < max(cfg.lengths):
        raise InputError(f"ppl_tokens ({cfg.ppl_tokens}) must be >= the longest context length "
                         f"({max(cfg.lengths)})")
    if cfg.sp_size < 1:
        raise InputError(f"sp_size must be >= 1, got {cfg.sp_size}")
    check_device(cfg.device)
    for p in cfg.corpus:
        if not Path(p).exists():
            raise InputNotFound(f"corpus file or directory not found: {p}")
    if cfg.model is not None and not Path(cfg.model).exists():
        raise InputNotFound(
            f"model path not found: {cfg.model} (give a local directory saved with "
            f"save_pretrained; nothing is downloaded)")


# ----------------------------------------------------------------------------- command line
def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        model=args.model, patterns=tuple(args.patterns or ()), include_sdpa=not args.no_sdpa,
        tasks=tuple(args.tasks), lengths=tuple(args.lengths or ()), stride=args.stride,
        ppl_tokens=args.ppl_tokens, corpus=tuple(args.corpus), text_field=args.text_field,
        passkey_lengths=tuple(args.passkey_lengths or ()), depths=tuple(args.depths),
        trials=args.trials, max_new_tokens=args.max_new_tokens, device=args.device,
        dtype=args.dtype, out_dir=args.out_dir, sp_size=args.sp_size, seed=args.seed,
        plots=not args.no_plots, progress=not args.no_progress, fresh=args.fresh)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the eval for parsed arguments. Bad values found before any model is built are
    ``parser.error`` (usage, exit 2); bad inputs found later (an empty corpus, …) leave as
    :class:`InputError` (one line, exit 1, see :func:`report_input_errors`)."""
    cfg = config_from_args(args)
    try:
        # Resolve patterns and validate before any model is built, so mistakes fail fast.
        for p in cfg.patterns:
            resolve_pattern(p)
        cfg = cfg.resolved()
        _validate(cfg)
    except InputError as e:
        parser.error(str(e))
    tokenizer = load_tokenizer(cfg)  # a model without a usable one: exit 1, as documented
    try:
        check_prompts(cfg, tokenizer)  # lengths too short for a prompt: before any model
    except InputError as e:
        parser.error(str(e))
    out = _run_eval(cfg, tokenizer)
    if not out["files"]:  # a non-zero rank of a sequence-parallel run
        return 0
    print(out["markdown"])
    print(f"\nwrote {', '.join(str(v) for v in out['files'].values())}")
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_eval_arguments(argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_libraries_if_redirected()
    return report_input_errors(lambda: run_from_args(args, parser), parser.prog)
