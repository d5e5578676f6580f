"""``torch.compile`` boundaries that cost nothing at import: ``torch.compiler.disable`` imports
dynamo (about a second, a few hundred modules) when it decorates, and nothing compiles before
dynamo is loaded, so the decorator can wait for the first call.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["disable_lazily"]


def disable_lazily(fn):
    """``torch.compiler.disable(fn)``, made at the first call: under ``torch.compile`` the call
    is still one opaque call (a graph break), never traced into."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        disabled = torch.compiler.disable(fn) if disabled is None else disabled
        return disabled(*args, **kwargs)

    return call
