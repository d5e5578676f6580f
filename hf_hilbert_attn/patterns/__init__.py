"""The shipped patterns, by name, and what a pattern argument may be.

The YAML files beside this module are installed with the package, so ``"longnet_lm"`` works
from anywhere (``configure``, the CLI); a pattern can also be written inline
(:data:`INLINE_FORM`, e.g. ``"256,1024:1,4:sliding:sinks=1"``). :func:`as_pattern` is the one
parser of every form. ``default.yaml`` is the pattern of a model whose config has no
``hilbert_attn`` entry (why this one: ``docs/decisions.md``, "Quality on a trained model").
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import List, Union

from ..pattern import DilatedPattern

__all__ = ["PATTERN_DIR", "DEFAULT_PATTERN", "INLINE_FORM", "names", "path", "load", "default",
           "parse_inline", "as_pattern"]

PATTERN_DIR = Path(__file__).resolve().parent
PatternLike = Union[DilatedPattern, dict, str, os.PathLike, None]


def names() -> List[str]:
    """Names of the shipped patterns (``default``, ``dense``, ``longnet_lm``, ...)."""
    return sorted(p.stem for p in PATTERN_DIR.glob("*.yaml"))


def path(name: str) -> Path:
    """The YAML file of the shipped pattern ``name``; ``ValueError`` naming the choices."""
    file = PATTERN_DIR / f"{name}.yaml"
    if not file.is_file():
        raise ValueError(f"unknown pattern {name!r}: shipped patterns are {names()}")
    return file


@lru_cache(maxsize=None)
def load(name: str) -> DilatedPattern:
    """The shipped pattern ``name`` (cached)."""
    return DilatedPattern.from_yaml(path(name))


def default() -> DilatedPattern:
    """The pattern of a model whose config has no ``hilbert_attn`` entry (``default.yaml``)."""
    return load("default")


# The default as a dict (``DilatedPattern.to_dict()``), for ``config.hilbert_attn``-style use.
DEFAULT_PATTERN = default().to_dict()


# The inline form: segment lengths : dilation rates, then options (window kind, sink tokens).
INLINE_FORM = "'W1,W2,...:R1,R2,...[:sliding|:segment][:sinks=K]'"


def _ints(text: str, what: str, spec: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"inline pattern {spec!r}: {what} must be comma-separated integers, got "
                         f"{text!r} (form {INLINE_FORM})") from None


def parse_inline(spec: str) -> DilatedPattern:
    """The pattern of an inline spec (:data:`INLINE_FORM`): ``"256,1024:1,4"`` is
    ``DilatedPattern([256, 1024], [1, 4])``; ``:sliding`` / ``:segment`` set ``window``,
    ``:sinks=K`` sets ``sink_tokens``; the other fields keep their defaults.

    Raises ``ValueError`` naming the spec and the bad part, or the pattern's own validation
    error.
    """
    if ":" not in spec:
        raise ValueError(f"inline pattern {spec!r} has no ':' between segment lengths and "
                         f"dilation rates (form {INLINE_FORM})")
    w_text, r_text, *options = spec.split(":")
    w, r = _ints(w_text, "segment lengths", spec), _ints(r_text, "dilation rates", spec)
    extra: dict = {}
    for opt in (o.strip() for o in options):
        if opt in ("sliding", "segment"):
            extra["window"] = opt
        elif opt.startswith("sinks="):
            try:
                k = int(opt[6:])
            except ValueError:
                raise ValueError(f"inline pattern {spec!r}: {opt!r} needs an integer count K >= 0 "
                                 f"of sink tokens (form {INLINE_FORM})") from None
            if k < 0:
                raise ValueError(f"inline pattern {spec!r}: {opt!r} is a negative count of sink "
                                 f"tokens; K must be >= 0 (form {INLINE_FORM})")
            extra["sink_tokens"] = k
        else:
            raise ValueError(f"inline pattern {spec!r}: option {opt!r} is not one of sliding, "
                             f"segment, sinks=K (form {INLINE_FORM})")
    return DilatedPattern(w, r, **extra)


@lru_cache(maxsize=64)
def _from_frozen(frozen: tuple) -> DilatedPattern:
    return DilatedPattern.from_dict({k: list(v) if isinstance(v, tuple) else v for k, v in frozen})


def as_pattern(pattern: PatternLike) -> DilatedPattern:
    """A :class:`DilatedPattern` from a pattern, its dict, a YAML path, a shipped name
    (:func:`names`), an inline spec (:func:`parse_inline`, e.g. ``"256,1024:1,4:sinks=1"``), or
    ``None`` (:func:`default`); dicts are cached per content (a per-layer call costs a dict
    walk). Raises ``ValueError`` (invalid pattern, unknown name), ``FileNotFoundError`` (a
    missing ``.yaml``) or ``TypeError`` (anything else).
    """
    if pattern is None:
        return default()
    if isinstance(pattern, DilatedPattern):
        return pattern
    if isinstance(pattern, dict):
        return _from_frozen(tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                                         for k, v in pattern.items())))  # hashable, by content
    if isinstance(pattern, (str, os.PathLike)):
        file = Path(pattern)
        if file.suffix in (".yaml", ".yml") or file.is_file():
            return DilatedPattern.from_yaml(file)
        if isinstance(pattern, str) and pattern in names():
            return load(pattern)
        if isinstance(pattern, str) and ":" in pattern:
            return parse_inline(pattern)
        raise ValueError(f"unknown pattern {str(pattern)!r}: give a YAML file, a shipped "
                         f"pattern name {names()} or an inline {INLINE_FORM}")
    raise TypeError(f"pattern must be a DilatedPattern, a dict, a YAML path, a shipped pattern "
                    f"name, an inline spec or None, got {type(pattern).__name__}")
