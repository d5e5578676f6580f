"""lm-evaluation-harness with ``attn_implementation="hilbert_dilated"`` registered.

``lm-eval`` builds its models itself and never imports this package, so Transformers does not
know ``hilbert_dilated`` there. This entry point registers it, then runs lm-eval's own command
line with the same arguments::

    pip install -e ".[lm-eval]"     # in a checkout (or a built wheel with [lm-eval])
    python -m hf_hilbert_attn.tools.lm_eval run --model hf \\
        --model_args pretrained=DIR,attn_implementation=hilbert_dilated --tasks TASKS ...
    hf-hilbert-attn lm-eval run --model hf ...          # the same

The pattern is the model's ``config.hilbert_attn`` (saved by ``hf_hilbert_attn.configure`` and
``save_pretrained``), else the default pattern. In Python, ``import hf_hilbert_attn`` before
``lm_eval.simple_evaluate(...)`` does the same.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]

_MISSING = ("lm-evaluation-harness is not installed: pip install -e '.[lm-eval]' in a checkout, "
            "or a built wheel with [lm-eval], or pip install lm_eval")


def main(argv: Optional[Sequence[str]] = None, prog: str = "lm-eval") -> None:
    """Register ``hilbert_dilated``, then run lm-eval's command line on ``argv`` (default:
    ``sys.argv[1:]``). lm-eval exits with its own status; a missing lm_eval is a one-line
    ``SystemExit`` naming the install command."""
    import hf_hilbert_attn

    hf_hilbert_attn.register()
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        if getattr(e, "name", None) not in ("lm_eval", "lm_eval.__main__"):
            raise  # lm_eval is there but broken: its own traceback says why
        raise SystemExit(f"{prog}: error: {_MISSING}") from None
    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = [prog, *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
