"""argparse value types shared by the eval, the model benchmark and the console command."""

from __future__ import annotations

import argparse


def parse_length(text: str) -> int:
    """``"4096"`` or ``"4k"`` (× 1024) → int; raises ``ArgumentTypeError`` naming the text."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length like 4096 or 4k, got {text!r}") from None


def length_type(what: str, minimum: int = 2):
    """An argparse type: a length (see :func:`parse_length`) of at least ``minimum``."""

    def parse(text: str) -> int:
        v = parse_length(text)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"a {what} must be >= {minimum}, got {v}")
        return v

    parse.__name__ = what.replace(" ", "_")
    return parse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
