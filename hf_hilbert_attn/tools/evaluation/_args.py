"""argparse value types, the pattern argument (:func:`resolve_pattern`) and the input error
shared by the eval, the benchmarks, the fine-tune and the console command."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, Tuple

from hf_hilbert_attn.pattern import DilatedPattern


class InputError(ValueError):
    """A bad input (argument, file, pattern, device): the commands report it as one line,
    ``PROG: error: MESSAGE`` with exit status 1, never as a traceback (``HF_HILBERT_DEBUG=1``
    shows the traceback)."""


class InputNotFound(InputError, FileNotFoundError):
    """An input path (model, corpus, pattern file) that does not exist."""


# A tool's own third-party package -> the extra that installs it (the library needs none of them).
TOOL_EXTRAS = {"datasets": "tools", "tqdm": "tools", "matplotlib": "tools", "gguf": "assets",
               "lm_eval": "lm-eval", "wonderwords": "ruler"}


def missing_extra(e: ImportError) -> str | None:
    """The install line for a tool's missing package, or None (not a tool's package: a bug)."""
    top = (getattr(e, "name", None) or "").split(".")[0]
    extra = TOOL_EXTRAS.get(top)
    if extra is None or not isinstance(e, ModuleNotFoundError):
        return None
    return f'{top} is not installed: pip install "hf_hilbert_attn[{extra}]"'


def report_input_errors(fn: Callable[[], int], prog: str, debug: bool = False) -> int:
    """``fn()``; an :class:`InputError` or a tool's missing package (:data:`TOOL_EXTRAS`) leaves as
    ``SystemExit("PROG: error: MESSAGE")`` (one line on stderr, exit status 1; under a launcher
    only rank 0 prints it). Any other exception keeps its traceback: it is a bug."""
    try:
        return fn()
    except (InputError, ModuleNotFoundError) as e:
        message = str(e) if isinstance(e, InputError) else missing_extra(e)
        if message is None or debug or os.environ.get("HF_HILBERT_DEBUG", "") not in ("", "0"):
            raise
        if int(os.environ.get("RANK", "0")) != 0:
            raise SystemExit(1) from None
        raise SystemExit(f"{prog or os.path.basename(sys.argv[0])}: error: {message}") from None


# Every command writes its results under one folder of the working directory, one subfolder per
# command (``--out``/``--out-dir`` chooses another): hf_hilbert_results/eval, .../bench_model, ...
RESULTS_ROOT = "hf_hilbert_results"


def results_dir(command: str) -> str:
    """The default output folder of ``command``: ``hf_hilbert_results/<command>``."""
    return f"{RESULTS_ROOT}/{command}"


def show_progress(wanted: bool = True) -> bool:
    """Whether to draw progress bars: ``wanted`` and stderr is a terminal (a redirected log gets
    no bars: each refresh would be a line of it)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(wanted and isatty is not None and isatty())


def quiet_libraries_if_redirected() -> None:
    """Turn off the progress bars of Transformers and Datasets (loading weights, writing shards,
    building a dataset) when stderr is not a terminal (a command's output sent to a log)."""
    if show_progress():
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


class LengthError(argparse.ArgumentTypeError, ValueError):
    """A text that is not a length: argparse prints its message; callers may catch ValueError."""


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_length(text: str) -> int:
    """``"4096"``, ``"4k"``/``"4K"`` (× 1024), ``"1M"`` (× 1024²) or ``"1G"`` (× 1024³) → int:
    the one length parser of every command (eval, bench, show-pattern, quality).

    Raises:
        LengthError (an ``argparse.ArgumentTypeError`` and a ``ValueError``): naming the text.
    """
    m = re.fullmatch(r"\s*(-?\d+)\s*([kKmMgG]?)\s*", str(text))  # sign: callers name the minimum
    if not m:
        raise LengthError(f"expected a length like 4096, 4K or 1M, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def length_type(what: str, minimum: int = 2):
    """An argparse type: a length (see :func:`parse_length`) of at least ``minimum``."""

    def parse(text: str) -> int:
        v = parse_length(text)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"a {what} must be >= {minimum}, got {v}")
        return v

    parse.__name__ = what.replace(" ", "_")
    return parse


def _int_at_least(minimum: int, words: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {words}, got {v}")
        return v

    return parse


positive_int = _int_at_least(1, "a positive integer")
nonneg_int = _int_at_least(0, "an integer >= 0")


def _unit_interval(what: str, name: str):
    """An argparse type: a float in ``[0, 1]``, errors naming ``what`` / ``name``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} in [0, 1], got {text!r}") from None
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {v}")
        return v
    return parse


depth = _unit_interval("a depth", "a needle depth")  # a needle depth in [0, 1]
fraction = _unit_interval("a fraction", "a fraction")  # e.g. a calibration budget


def check_eval_grid(tasks, known_tasks, lengths, passkey_lengths, depths, trials,
                    error=ValueError) -> None:
    """The checks the eval and the quality study share; raises ``error`` naming the value."""
    bad = [t for t in tasks if t not in known_tasks]
    if bad or not tasks:
        raise error(f"tasks must be among {list(known_tasks)}, got {list(tasks)}")
    for name, values in (("lengths", lengths), ("passkey_lengths", passkey_lengths)):
        for x in values:
            if int(x) < 2:
                raise error(f"{name} must be integers >= 2, got {x}")
    for d in depths:
        if not 0.0 <= float(d) <= 1.0:
            raise error(f"depths must be in [0, 1], got {d}")
    if trials < 1:
        raise error(f"trials must be >= 1, got {trials}")


def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N``, …; a CUDA device where torch has none is an
    :class:`InputError` naming what torch here can use."""
    import torch

    if device == "auto":
        return
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise InputError(f"--device {device}: {why}; use --device cpu (or auto)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) here")


# ----------------------------------------------------------------------------- patterns
# Built-in patterns by name, beside the shipped YAMLs of hf_hilbert_attn/patterns/.
# "tiny" suits the built-in model's 128–512-token contexts: dense within 64 tokens, then every
# 4th token of a 256-token segment.
BUILTIN_PATTERNS = {
    "tiny": DilatedPattern([64, 256], [1, 4]),
    "dense": DilatedPattern.dense(1 << 30),
}


def resolve_pattern(spec: str) -> Tuple[str, DilatedPattern]:
    """A pattern from a YAML path, a shipped config name, a built-in name or an inline spec.

    Accepted, in this order: a ``.yaml`` file; a shipped pattern name
    (``hf_hilbert_attn.patterns.names()``: ``default``, ``dense``, ``longnet_lm``, ...); a
    built-in name (``tiny``); an inline spec, parsed by
    :func:`hf_hilbert_attn.patterns.parse_inline` (``"W1,W2,...:R1,R2,..."``: segment lengths :
    dilation rates, optionally followed by ``:sliding`` and ``:sinks=K``).

    Returns:
        ``(label, pattern)``; the label names it in tables and plots.

    Raises:
        InputNotFound (a ``FileNotFoundError``): a path-like spec (ending in .yaml/.yml) that
            does not exist.
        InputError (a ``ValueError``): an unknown name, a malformed inline spec, a YAML file
            that does not parse, or the pattern's own validation error (e.g.
            ``dilation_rates[0] must be <= segment_lengths[0] …``).
    """
    try:
        return _resolve_pattern(spec)
    except FileNotFoundError as e:
        raise InputNotFound(str(e)) from None
    except (ValueError, TypeError) as e:  # the pattern's validation names the field
        raise InputError(str(e)) from None


def _pattern_file(path: Path) -> DilatedPattern:
    import yaml

    try:
        return DilatedPattern.from_yaml(path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise InputError(f"pattern file {path} is not valid YAML: {problem}{where}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise InputError(f"pattern file {path}: {e}") from None


def _resolve_pattern(spec: str) -> Tuple[str, DilatedPattern]:
    from hf_hilbert_attn import patterns

    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        return path.stem, _pattern_file(path)
    if spec in patterns.names():
        return spec, patterns.load(spec)
    if spec in BUILTIN_PATTERNS:
        return spec, BUILTIN_PATTERNS[spec]
    if ":" in spec:  # the one inline parser: hf_hilbert_attn.patterns.parse_inline
        pattern = patterns.parse_inline(spec)
        w_text, r_text, *options = spec.split(":")
        label = "_".join([w_text + "_r" + r_text] + options).replace(",", "-").replace("=", "")
        return label, pattern
    raise ValueError(
        f"unknown pattern {spec!r}: give a .yaml file, a shipped pattern name "
        f"{patterns.names()}, a built-in name {sorted(BUILTIN_PATTERNS)}, or an inline "
        f"{patterns.INLINE_FORM}"
    )
