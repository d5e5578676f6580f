"""Fine-tune a causal LM with dilated attention, optionally with sequence parallelism.

The code is the installed module ``hf_hilbert_attn.tools.finetune`` (``python -m
hf_hilbert_attn.tools.finetune --help`` works without this checkout); this script runs it, so every
command in the docs may name either. Examples::

    torchrun --nproc_per_node 2 examples/finetune.py --seq-len 512 --max-steps 20
    python examples/finetune.py --model DIR --data corpus/train --attn sdpa
"""
import sys
from pathlib import Path

try:
    import hf_hilbert_attn  # noqa: F401
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_hilbert_attn.tools.finetune import *  # noqa: E402,F401,F403  (tests load helpers from here)
from hf_hilbert_attn.tools.finetune import main  # noqa: E402

if __name__ == "__main__":
    main()
