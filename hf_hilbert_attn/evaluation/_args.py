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


def depth(text: str) -> float:
    """A needle depth in ``[0, 1]``."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a depth in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"a needle depth must be in [0, 1], got {v}")
    return v


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
