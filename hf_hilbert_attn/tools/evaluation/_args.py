"""argparse value types (defined in :mod:`hf_hilbert_attn.tools.cli`, whose parser must not
import torch), the pattern argument (:func:`resolve_pattern`) and the input error shared by the
eval, the benchmarks, the fine-tune and the console command."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Tuple

from hf_hilbert_attn.pattern import DilatedPattern

# The argument values: every tool imports them from here, as before.
from ..options import (RESULTS_ROOT, LengthError, budget, depth, fraction, length_type,  # noqa: F401
                   nonneg_int, parse_length, positive_int, results_dir)


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
    return (f'{top} is not installed: the {extra} extra, pip install -e ".[{extra}]" in a '
            f'checkout or a built wheel with [{extra}]')


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
    builtin = sorted(set(BUILTIN_PATTERNS) - set(patterns.names()))  # ('dense' is both)
    raise ValueError(
        f"unknown pattern {spec!r}: give a .yaml file, a shipped pattern name "
        f"{patterns.names()}, a built-in name {builtin}, or an inline "
        f"{patterns.INLINE_FORM}"
    )
