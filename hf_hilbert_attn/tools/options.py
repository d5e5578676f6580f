"""The command line's argument values and the options of ``eval``, ``calibrate`` and
``quality``: the standard library only, so that ``hf-hilbert-attn --help`` and argument errors do
not wait for torch and Transformers. ``cli.py`` builds the parsers from them; the tools import
them from here."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import List

# ----------------------------------------------------------------------------- argument values
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


def _unit_interval(what: str, name: str, open_at_zero: bool = False, why: str = ""):
    """An argparse type: a float in ``[0, 1]`` (``(0, 1]`` with ``open_at_zero``), errors naming
    ``what`` / ``name``."""
    lo = "(" if open_at_zero else "["

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what} in {lo}0, 1], got {text!r}") from None
        if not (0.0 < v if open_at_zero else 0.0 <= v) or not v <= 1.0:
            raise argparse.ArgumentTypeError(f"{name} must be in {lo}0, 1], got {v}{why}")
        return v
    return parse


depth = _unit_interval("a depth", "a needle depth")  # a needle depth in [0, 1]
fraction = _unit_interval("a fraction", "a fraction")
# calibrate --budget: 0 would make no head dense, after a whole calibration
budget = _unit_interval("a fraction", "--budget", open_at_zero=True,
                        why=" (0 makes no head dense: nothing to calibrate)")

# Every command writes its results under one folder of the working directory, one subfolder per
# command (``--out``/``--out-dir`` chooses another): hf_hilbert_results/eval, .../bench_model, ...
RESULTS_ROOT = "hf_hilbert_results"


def results_dir(command: str) -> str:
    """The default output folder of ``command``: ``hf_hilbert_results/<command>``."""
    return f"{RESULTS_ROOT}/{command}"


_PACKAGE = Path(__file__).resolve().parents[1]  # hf_hilbert_attn/, found without importing it
# hf_hilbert_attn.patterns.INLINE_FORM (a test keeps the two equal)
INLINE_FORM = "'W1,W2,...:R1,R2,...[:sliding|:segment][:sinks=K]'"


def _pattern_names() -> List[str]:
    """``hf_hilbert_attn.patterns.names()`` without importing the package (a test compares)."""
    return sorted(p.stem for p in (_PACKAGE / "patterns").glob("*.yaml"))


def _pattern_help(default: str) -> str:
    return (f"a shipped name ({', '.join(_pattern_names())}), a built-in name (tiny), a YAML "
            f"file or inline {INLINE_FORM}. {default}")


def _package_version() -> str:
    root = sys.modules.get("hf_hilbert_attn")
    version = getattr(root, "__version__", None)
    if version:
        return version
    try:
        from importlib.metadata import version as dist_version

        return dist_version("hf_hilbert_attn")
    except Exception:  # noqa: BLE001 - not installed: say so
        return "unknown"


# ----------------------------------------------------------------------------- eval options
EVAL_TASKS = ("perplexity", "passkey", "ruler")


def add_eval_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``hf-hilbert-attn eval`` (:mod:`.evaluation.runner`)."""
    length = length_type("context length")
    p.add_argument("model", nargs="?", default=None,
                   help="local model directory (save_pretrained); omit for the built-in tiny "
                        "random-initialised Llama with a character tokenizer (a CPU smoke run)")
    p.add_argument("--pattern", action="append", dest="patterns", default=None,
                   help="pattern for hilbert_dilated, repeatable: " + _pattern_help(
                       "Default: dense and tiny for the built-in model, default for a model "
                       "path"))
    p.add_argument("--no-sdpa", action="store_true", help="do not evaluate the sdpa baseline")
    p.add_argument("--tasks", nargs="+", choices=EVAL_TASKS, default=["perplexity", "passkey"],
                   help="ruler: the RULER-style retrieval tasks (evaluation.ruler) at the passkey "
                        "lengths and depths, teacher-forced; the mean per task printed, "
                        "ruler.csv and heat maps (the built-in model's prompts are then 512 "
                        "tokens long by default); list every task wanted: --tasks perplexity "
                        "passkey ruler")
    p.add_argument("--lengths", nargs="+", type=length, default=None,
                   help="context lengths for perplexity (and passkey unless --passkey-lengths); "
                        "default 128 256 512 (built-in) or 2k 4k 8k 16k")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="window stride in tokens (default: half of each length)")
    p.add_argument("--ppl-tokens", type=positive_int, default=None,
                   help="tokens of the corpus to score (default 4 × the longest length)")
    p.add_argument("--corpus", nargs="+", default=[],
                   help="local .txt/.jsonl/.parquet files, or directories of them (each "
                        "file inside, not recursive), e.g. the heldout/ of fetch-corpus (default: "
                        "a built-in generated corpus)")
    p.add_argument("--text-field", default="text", help="text column of jsonl/parquet files")
    p.add_argument("--passkey-lengths", nargs="+", type=length, default=None,
                   help="prompt lengths of passkey and ruler (default: --lengths)")
    p.add_argument("--depths", nargs="+", type=depth, default=[0.0, 0.5, 1.0],
                   help="needle depths in [0, 1]")
    p.add_argument("--trials", type=positive_int, default=2, help="passkey prompts per cell")
    p.add_argument("--max-new-tokens", type=positive_int, default=8)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, …")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--out-dir", default=None,
                   help=f"where results.md/.csv and PNGs go (default {results_dir('eval')}/"
                        "<the model folder's name, or builtin>); results.csv is written after "
                        "every cell, and a rerun with the same settings resumes from it")
    p.add_argument("--fresh", action="store_true",
                   help="discard OUT_DIR/results.csv instead of resuming from it")
    p.add_argument("--sp-size", type=positive_int, default=1,
                   help="sequence-parallel group size for the perplexity windows (needs "
                        "`accelerate launch`/`torchrun` and hf_hilbert_attn.sharding)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (bars on a terminal, else a line per stage on stderr)")
    return p


# ----------------------------------------------------------------------------- calibrate options
CALIBRATE_METHODS = ("needle_mass", "ablation")  # evaluation.calibrate.METHODS


def add_calibrate_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``hf-hilbert-attn calibrate`` (:mod:`.evaluation.calibrate`)."""
    p.add_argument("model", metavar="MODEL", help="a model directory (save_pretrained layout)")
    p.add_argument("--budget", type=budget, default=0.1,
                   help="at most this fraction of all (layer, key/value head) pairs become dense, "
                        "in (0, 1] (default 0.1: on SmolLM2-135M 18 %% of the causal pairs at "
                        "64K, passkey and NIAH at 4K as dense; docs/retrieval.md)")
    p.add_argument("--method", choices=CALIBRATE_METHODS, default="needle_mass",
                   help="needle_mass: attention mass on the needle in one dense pass (default; "
                        "about a second on one GPU); ablation: each head's measured gain in "
                        "answer log-likelihood, then greedy additions (minutes; retrieved less "
                        "at 8K and extrapolated worse in our study)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write a calibrated copy of MODEL here (every file of MODEL copied as "
                        "is, config.json with the dense heads). Default: update MODEL/config.json "
                        "in place (only its 'hilbert_attn' entry; the weights are not touched)")
    p.add_argument("--pattern", default=None,
                   help="the sparse pattern to calibrate (a shipped name, YAML file or inline "
                        "form; default: the model's own, else the default pattern)")
    p.add_argument("--lengths", type=length_type("--lengths", 64), nargs="+", default=None,
                   help="prompt lengths, each above the pattern's dense window (default: 2x and "
                        "4x the pattern's first window, at most the model's "
                        "max_position_embeddings)")
    p.add_argument("--trials", type=positive_int, default=1,
                   help="prompts per task x length x depth (default 1; 5 depths, 3 tasks)")
    p.add_argument("--rescore", type=nonneg_int, default=4,
                   help="ablation: candidates scored again after each addition (default 4)")
    p.add_argument("--batch-tokens", type=positive_int, default=65536,
                   help="tokens per forward (default 65536)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="weights while calibrating (default: bfloat16 on CUDA, float32 on CPU; "
                        "the saved weights are MODEL's files either way)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (a bar on a terminal, else a line per stage on stderr)")
    return p


# ----------------------------------------------------------------------------- quality options
QUALITY_STAGES = ("base", "finetuned")  # evaluation.quality_data.STAGES
QUALITY_TASKS = ("perplexity", "passkey")  # evaluation.quality_data.TASKS
# evaluation.quality.DEFAULT_METHODS, installed with the package
QUALITY_METHODS = _PACKAGE / "tools" / "evaluation" / "quality_study.yaml"


def add_quality_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``hf-hilbert-attn quality`` (:mod:`.evaluation.quality`)."""
    length = length_type("context length")
    p.add_argument("--model", help="local Hugging Face causal LM directory (with its tokenizer)")
    p.add_argument("--corpus", help="directory with train/ and heldout/ of .txt files (each file "
                                    "one document)")
    p.add_argument("--methods", default=str(QUALITY_METHODS),
                   help="YAML list of methods: label, attn_implementation (sdpa | "
                        "hilbert_dilated), pattern (a shipped name, YAML path or inline dict); "
                        "default: the packaged quality_study.yaml")
    p.add_argument("--methods-filter", nargs="+", default=[], metavar="LABEL",
                   help="run only these labels (shell globs, e.g. 'seg*' sdpa); in the "
                        "packaged study, label 'default' is the pattern the study replaced, and "
                        "the shipped default pattern is 'slide2k_sink1'")
    p.add_argument("--out", default=results_dir("quality"),
                   help="output directory (default %(default)s)")
    p.add_argument("--lengths", nargs="+", type=length, default=[1024, 2048, 4096, 8192],
                   help="perplexity context lengths (default 1k 2k 4k 8k; 16k 32k accepted)")
    p.add_argument("--ppl-tokens", type=positive_int, default=65536,
                   help="held-out tokens scored at every length (default 65536, or all there are)")
    p.add_argument("--passkey-lengths", nargs="+", type=length, default=[1024, 2048, 4096, 8192])
    p.add_argument("--depths", nargs="+", type=depth, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=positive_int, default=6, help="passkey prompts per depth")
    p.add_argument("--tasks", nargs="+", choices=QUALITY_TASKS, default=list(QUALITY_TASKS))
    p.add_argument("--stages", nargs="+", choices=QUALITY_STAGES, default=None,
                   help="default: base, plus finetuned when --finetune-steps > 0 "
                        "(--stages finetuned skips the base eval)")
    p.add_argument("--finetune-steps", type=nonneg_int, default=0,
                   help="fine-tune steps per method (0: no fine-tune)")
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--finetune-warmup", type=nonneg_int, default=10, help="linear warm-up steps")
    p.add_argument("--finetune-seq-len", type=length, default=8192)
    p.add_argument("--finetune-args", default="",
                   help="more arguments for hf_hilbert_attn.tools.finetune, one string "
                        "(e.g. '--gradient-checkpointing --loss-chunk 4096')")
    p.add_argument("--batch-tokens", type=positive_int, default=65536,
                   help="tokens per eval forward (windows / passkey prompts batched up to it)")
    p.add_argument("--dtype", default="auto",
                   choices=("auto", "autocast-bf16", "float32", "bfloat16", "float16"),
                   help="auto: fp32 weights + bf16 autocast on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true",
                   help="discard OUT/quality.csv instead of resuming from it")
    p.add_argument("--report-only", metavar="OUT", default=None,
                   help="only redraw quality.md and the PNGs from OUT/quality.csv")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (a bar on a terminal, else a line per block on stderr)")
    return p
