"""Helpers shared by the tests: fresh random patterns, and the closeness assertion that prints
where a result differs from its reference."""

from __future__ import annotations

import random
from typing import Optional

import torch

from hf_hilbert_attn import DilatedPattern

__all__ = ["random_pattern", "assert_close", "run_finetune_here"]


def random_pattern(rng: random.Random, length: Optional[int] = None, *, max_w: Optional[int] = None,
                   min_w: int = 1, max_rate: int = 8, mode: Optional[str] = None,
                   window: Optional[str] = "segment", sinks: Optional[int] = 0,
                   nested: bool = False) -> DilatedPattern:
    """A fresh valid pattern of 1-3 configs: any segment lengths and rates (not nested, not
    powers of two), per_head patterns with a rate-1 config somewhere.

    Args:
        rng: the test's ``random.Random``.
        length: the sequence length; segments reach ~1.3x it (so the last, partial segment and
            single-segment configs both occur). Or ``max_w``: segments in ``[min_w, max_w]``.
        max_rate: rates in ``[1, min(w, max_rate)]``.
        mode: ``"per_head"`` / ``"all"``; None draws one.
        window: ``"segment"`` / ``"sliding"``; None draws one.
        sinks: sink tokens; None draws from 0, 1, 3, 50.
        nested: half the time nested windows ``base * 2**j`` (plus up to 2) with rates
            ``2**j``, sometimes in reverse order (earlier configs then cover later ones' short
            distances).
    """
    if (length is None) == (max_w is None):
        raise ValueError("give either length or max_w")
    hi = max_w if max_w is not None else max(2, int(1.3 * length))
    n = rng.randint(1, 3)
    mode = mode or rng.choice(["per_head", "all"])
    if nested and rng.random() < 0.5:
        base = rng.randint(1, max(1, (length or hi) // 4))
        w = [base * 2 ** j + rng.randint(0, 2) for j in range(n)]
        r = [min(wi, 2 ** j) for j, wi in enumerate(w)]
        if rng.random() < 0.3:
            w.reverse()
            r.reverse()
    else:
        w = [rng.randint(min(min_w, hi), hi) for _ in range(n)]
        r = [rng.randint(1, min(wi, max_rate)) for wi in w]
    if mode == "per_head" and 1 not in r:
        r[rng.randrange(n)] = 1
    window = window or rng.choice(["segment", "sliding"])
    sinks = rng.choice([0, 0, 1, 3, 50]) if sinks is None else sinks
    return DilatedPattern(w, r, query_dilation=mode, window=window, sink_tokens=sinks)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "", *,
                 elementwise: bool = False) -> None:
    """``got`` matches the reference ``want``: same shape, the same non-finite entries (an empty
    row's ``-inf`` lse), and on the finite ones ``|got - want| <= tol * max(1, max |want|)`` —
    or, ``elementwise``, ``<= tol * (1 + |want|)`` entry by entry. Compared in float64; the
    message names the worst (or first) index and both values."""
    got, want = got.double(), want.double()
    where = f"{what} {name}".strip()
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    fg, fw = torch.isfinite(got), torch.isfinite(want)
    bad = (fg != fw).nonzero()
    assert bad.numel() == 0, f"{where}: finiteness differs at {bad[:5].tolist()}"
    assert torch.equal(got[~fg], want[~fw]), f"{where}: non-finite values differ"
    if not fw.any():
        return
    diff = torch.where(fw, (got - want).abs(), torch.zeros_like(got))
    if elementwise:
        wrong = diff > tol * (1 + want.abs().nan_to_num(0.0, 0.0, 0.0))
        assert not wrong.any(), (
            f"{where}: {int(wrong.sum())} mismatches, max err {float(diff.max()):.3e}, first at "
            f"{wrong.nonzero()[:5].tolist()}")
        return
    scale = max(1.0, float(want[fw].abs().max()))
    if float(diff.max()) > tol * scale:
        at = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{where}: max error {float(diff.max()):.3g} > {tol:g} * {scale:.3g} "
                             f"at {list(at)} (got {float(got[at]):.6g}, want {float(want[at]):.6g})")


def run_finetune_here(main, argv) -> None:
    """``main(argv)`` of the fine-tune (``hf_hilbert_attn.tools.finetune``, or
    examples/finetune.py's) in this process: a one-process run costs its steps, not a process
    that spends seconds importing. Accelerate's process state is a singleton, shared with
    whatever ran here before: cleared before and after, as in a fresh process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        main([str(a) for a in argv])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
