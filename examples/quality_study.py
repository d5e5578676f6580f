"""Quality of dilated patterns on a real model against dense sdpa, before and after the same
short fine-tune: perplexity by context length, teacher-forced passkey, density, step time.

    python examples/quality_study.py --model smollm2 --corpus shakespeare \
        --finetune-steps 150 --out quality_results

Same as ``hf-hilbert-attn quality``; the logic lives in
``hf_hilbert_attn.tools.evaluation.quality``.
"""

import sys
from pathlib import Path

try:
    from hf_hilbert_attn.tools.evaluation.quality import main
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_hilbert_attn.tools.evaluation.quality import main

if __name__ == "__main__":
    sys.exit(main(prog="quality_study.py"))
