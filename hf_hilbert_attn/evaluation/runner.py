"""The long-context eval: perplexity vs context length, passkey retrieval, tokens/s and memory,
for ``sdpa`` and ``hilbert_dilated`` with one or more patterns. Command-line entry points:
``hf-hilbert-attn eval`` and ``examples/eval_long_context.py`` (both call :func:`main`)."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..pattern import DilatedPattern
from . import report
from .corpus import build_char_tokenizer, build_default_model, load_corpus, tokenize_corpus
from ._args import check_eval_grid, depth, length_type, positive_int
from .measure import Meter
from .passkey import evaluate_passkey, hf_generate_fn, make_passkey_prompt
from .perplexity import count_windows, evaluate_perplexity

logger = logging.getLogger(__name__)

__all__ = ["EvalConfig", "Method", "resolve_pattern", "hilbert_available", "run_eval",
           "add_eval_arguments", "config_from_args", "main"]

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "patterns"  # installed with the package

# Built-in patterns by name, beside the shipped YAMLs of hf_hilbert_attn/patterns/.
# "tiny" suits the built-in model's 128–512-token contexts: dense within 64 tokens, then every
# 4th token of a 256-token segment.
BUILTIN_PATTERNS = {
    "tiny": DilatedPattern([64, 256], [1, 4]),
    "dense": DilatedPattern.dense(1 << 30),
}


def resolve_pattern(spec: str) -> Tuple[str, DilatedPattern]:
    """A pattern from a YAML path, a shipped config name, a built-in name or an inline spec.

    Accepted, in this order: an existing ``.yaml`` file; a name of ``hf_hilbert_attn/patterns/NAME.yaml`` (e.g.
    ``dense``, ``longnet_lm``, ``default``); a built-in name (``tiny``, ``dense``); inline
    ``"W1,W2,...:R1,R2,..."`` (segment lengths : dilation rates, per_head, natural), optionally
    followed by ``:sliding`` (window kind) and ``:sinks=K`` (sink tokens).

    Returns:
        ``(label, pattern)``; the label names it in tables and plots.

    Raises:
        FileNotFoundError: a path-like spec (ending in .yaml/.yml) that does not exist.
        ValueError: an unknown name, a malformed inline spec, or the pattern's own validation
            error (e.g. ``dilation_rates[0] must be <= segment_lengths[0] …``).
    """
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        return path.stem, DilatedPattern.from_yaml(path)
    if (CONFIGS_DIR / f"{spec}.yaml").is_file():
        return spec, DilatedPattern.from_yaml(CONFIGS_DIR / f"{spec}.yaml")
    if spec in BUILTIN_PATTERNS:
        return spec, BUILTIN_PATTERNS[spec]
    if ":" in spec:
        w_text, r_text, *options = spec.split(":")
        try:
            w = [int(x) for x in w_text.split(",") if x.strip()]
            r = [int(x) for x in r_text.split(",") if x.strip()]
            extra = {}
            for opt in options:
                if opt in ("sliding", "segment"):
                    extra["window"] = opt
                elif opt.startswith("sinks="):
                    extra["sink_tokens"] = int(opt[len("sinks="):])
                else:
                    raise ValueError(opt)
        except ValueError:
            raise ValueError(
                f"inline pattern {spec!r} must be 'W1,W2,...:R1,R2,...' with integers, optionally "
                "followed by ':sliding' and ':sinks=K'"
            ) from None
        label = "_".join([w_text + "_r" + r_text] + options).replace(",", "-").replace("=", "")
        return label, DilatedPattern(w, r, **extra)
    shipped = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []
    raise ValueError(
        f"unknown pattern {spec!r}: give a .yaml file, a shipped config name {shipped}, a built-in "
        f"name {sorted(BUILTIN_PATTERNS)}, or an inline 'W1,W2:R1,R2' spec"
    )


def hilbert_available() -> bool:
    """Whether ``import hf_hilbert_attn`` registered the ``hilbert_dilated`` attention."""
    import hf_hilbert_attn  # noqa: F401  (registers on import once the integration exists)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return "hilbert_dilated" in ALL_ATTENTION_FUNCTIONS.valid_keys()


def apply_pattern(model, pattern: DilatedPattern) -> None:
    """Give ``model`` its pattern: ``hf_hilbert_attn.configure`` where it exists, else the
    ``config.hilbert_attn`` dict it reads (DESIGN §3)."""
    import hf_hilbert_attn

    configure = getattr(hf_hilbert_attn, "configure", None)
    if configure is not None:
        configure(model, pattern)
    else:
        model.config.hilbert_attn = pattern.to_dict()


@dataclass(frozen=True)
class Method:
    """One attention implementation to evaluate (and its pattern, for hilbert_dilated)."""

    attn_implementation: str
    pattern_label: str = ""
    pattern: Optional[DilatedPattern] = None

    @property
    def label(self) -> str:
        return self.attn_implementation + (f":{self.pattern_label}" if self.pattern_label else "")


@dataclass
class EvalConfig:
    """What to evaluate; the defaults are the built-in CPU run (``model=None``)."""

    model: Optional[str] = None
    patterns: Sequence[str] = ()
    include_sdpa: bool = True
    tasks: Sequence[str] = ("perplexity", "passkey")
    lengths: Sequence[int] = ()
    stride: Optional[int] = None  # tokens; default length // 2
    ppl_tokens: Optional[int] = None  # default 4 × the longest length
    corpus: Sequence[str] = ()
    text_field: str = "text"
    passkey_lengths: Sequence[int] = ()
    depths: Sequence[float] = (0.0, 0.5, 1.0)
    trials: int = 2
    max_new_tokens: int = 8
    device: str = "auto"
    dtype: str = "auto"
    out_dir: str = "eval_results"
    sp_size: int = 1
    seed: int = 0
    plots: bool = True
    progress: bool = True

    def resolved(self) -> "EvalConfig":
        builtin = self.model is None
        c = EvalConfig(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        if not c.patterns:
            c.patterns = ("dense", "tiny") if builtin else ("default",)
        if not c.lengths:
            c.lengths = (128, 256, 512) if builtin else (2048, 4096, 8192, 16384)
        c.lengths = tuple(sorted(int(x) for x in c.lengths))
        if not c.passkey_lengths:
            c.passkey_lengths = c.lengths
        if c.ppl_tokens is None:
            c.ppl_tokens = 4 * max(c.lengths)
        return c


# ----------------------------------------------------------------------------- model loading
def _device_and_dtype(cfg: EvalConfig):
    if cfg.device == "auto" and torch.cuda.is_available():
        # one GPU per process under torchrun / accelerate launch
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    elif cfg.device == "auto":
        device = torch.device("cpu")
    else:
        device = torch.device(cfg.device)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype


def load_tokenizer(cfg: EvalConfig):
    if cfg.model is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model)


def load_model(cfg: EvalConfig, method: Method, tokenizer, device, dtype):
    """The model of ``cfg`` with ``method``'s attention (and pattern), on ``device`` in ``dtype``."""
    if cfg.model is None:
        model = build_default_model(tokenizer, seed=cfg.seed)
        if method.attn_implementation != "sdpa":
            model.set_attn_implementation(method.attn_implementation)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            cfg.model, attn_implementation=method.attn_implementation, dtype=dtype)
    if method.pattern is not None:
        apply_pattern(model, method.pattern)
    return model.to(device=device, dtype=dtype).eval()


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sequence parallel
def sequence_parallel_support() -> Tuple[bool, str]:
    """Whether sequence-parallel eval can run here, and why not if it cannot."""
    import hf_hilbert_attn

    missing = []
    if not hasattr(hf_hilbert_attn, "sequence_parallel"):
        missing.append("hf_hilbert_attn.sequence_parallel")
    if importlib.util.find_spec("hf_hilbert_attn.sharding") is None:
        missing.append("hf_hilbert_attn.sharding")
    if missing:
        return False, (f"sequence parallelism needs {' and '.join(missing)}, which this install "
                       f"does not have yet")
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False, ("sequence parallelism needs a process group: start the eval with "
                       "`accelerate launch` or `torchrun --nproc_per_node N`")
    return True, ""


def _sp_window_nll(model, ids: torch.Tensor, num_scored: int, topo, pattern) -> float:
    """Summed NLL of one window with its sequence sharded over the SP group (ring attention).

    ``shard_for_sequence_parallel`` shards ``input_ids`` and the (unshifted) labels, which are
    -100 on unscored tokens, and returns this shard's already shifted ``shift_labels``; every
    rank sums its shard's NLL and the sums are all-reduced over the group.
    """
    import hf_hilbert_attn
    from hf_hilbert_attn.integrations.accelerate import shard_for_sequence_parallel

    L = ids.shape[1]
    labels = ids.clone()
    labels[0, :L - num_scored] = -100
    shard = shard_for_sequence_parallel({"input_ids": ids, "labels": labels}, topo,
                                        pattern=pattern)
    with hf_hilbert_attn.sequence_parallel(topo.group), torch.inference_mode():
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                       use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), shard["shift_labels"].flatten().to(logits.device),
            ignore_index=-100, reduction="sum")
    torch.distributed.all_reduce(nll, group=topo.group)
    return float(nll)


# ----------------------------------------------------------------------------- the eval
def build_methods(cfg: EvalConfig) -> Tuple[List[Method], List[str]]:
    """The methods to run and notes about any that cannot run here."""
    methods, notes = [], []
    if cfg.include_sdpa:
        methods.append(Method("sdpa"))
    patterns = [resolve_pattern(p) for p in cfg.patterns]
    if patterns and not hilbert_available():
        notes.append("hilbert_dilated is not registered in this install (hf_hilbert_attn's "
                     "Transformers integration is missing); its rows were skipped")
    else:
        methods += [Method("hilbert_dilated", label, p) for label, p in patterns]
    return methods, notes


def run_eval(cfg: EvalConfig) -> Dict:
    """Run the eval of ``cfg`` and write its results into ``cfg.out_dir``.

    Returns:
        ``{"rows": [...], "files": {...}, "markdown": str, "notes": [...]}``; the rows are also
        in ``results.csv``.

    Raises:
        ValueError / FileNotFoundError: bad lengths, depths, patterns or corpus files.
    """
    from tqdm.auto import tqdm

    cfg = cfg.resolved()
    _validate(cfg)
    device, dtype = _device_and_dtype(cfg)
    methods, notes = build_methods(cfg)
    if not methods:
        raise ValueError("nothing to evaluate: no sdpa and no runnable hilbert_dilated pattern")

    topo, rank = None, 0
    if cfg.sp_size > 1:
        _init_distributed(device)
        ok, why = sequence_parallel_support()
        if not ok:
            raise RuntimeError(f"--sp-size {cfg.sp_size}: {why}")
        from ..integrations.accelerate import sequence_parallel_topology

        topo = sequence_parallel_topology(None, cfg.sp_size)
        rank = torch.distributed.get_rank()
        notes.append(f"hilbert_dilated perplexity windows sharded over {cfg.sp_size} ranks (ring "
                     f"attention); sdpa and passkey (generate) run unsharded on every rank")

    tokenizer = load_tokenizer(cfg)
    if "passkey" in cfg.tasks:  # fail before any model runs if the shortest prompt cannot fit
        make_passkey_prompt(tokenizer, min(cfg.passkey_lengths), 0.0, "12345")
    rows: List[Dict] = []
    tokens = None
    if "perplexity" in cfg.tasks:
        docs = load_corpus(cfg.corpus, text_field=cfg.text_field,
                           num_chars=max(200_000, 2 * cfg.ppl_tokens))
        tokens = tokenize_corpus(tokenizer, docs, cfg.ppl_tokens)
        if tokens.numel() < 2:
            raise ValueError("the corpus tokenised to fewer than 2 tokens")
        if tokens.numel() < max(cfg.lengths):
            notes.append(f"the corpus has only {tokens.numel()} tokens: windows longer than that "
                         f"are cut to it")
    model_name = cfg.model or "builtin-tiny-llama"
    common = dict(model=model_name, device=str(device), dtype=str(dtype).replace("torch.", ""))
    disable = not cfg.progress or rank != 0

    for method in methods:
        model = load_model(cfg, method, tokenizer, device, dtype)
        if "perplexity" in cfg.tasks:
            for L in cfg.lengths:
                stride = cfg.stride or max(1, L // 2)
                n_win = count_windows(int(tokens.numel()), L, stride)
                with tqdm(total=n_win, desc=f"{method.label} ppl L={L}", disable=disable,
                          leave=False) as bar, Meter(device) as m:
                    if topo is None or method.pattern is None:
                        res = evaluate_perplexity(model, tokens, L, stride, progress=bar)
                    else:
                        res = _sp_perplexity(model, tokens, L, stride, topo, method.pattern, bar)
                rows.append(dict(common, method=method.label, task="perplexity", length=L,
                                 depth="", value=res.perplexity, stride=stride,
                                 scored_tokens=res.scored_tokens,
                                 processed_tokens=res.processed_tokens, seconds=m.seconds,
                                 tokens_per_s=res.processed_tokens / max(m.seconds, 1e-9),
                                 peak_mem_mb=m.peak_bytes / 2**20, mem_kind=m.kind))
        if "passkey" in cfg.tasks:
            gen = hf_generate_fn(model, tokenizer, cfg.max_new_tokens)
            for L in cfg.passkey_lengths:
                with tqdm(total=len(cfg.depths) * cfg.trials, desc=f"{method.label} passkey L={L}",
                          disable=disable, leave=False) as bar, Meter(device) as m:
                    res = evaluate_passkey(gen, tokenizer, L, cfg.depths, cfg.trials,
                                           seed=cfg.seed, progress=bar)
                total_tokens = sum(r["prompt_tokens"] for r in res)
                for r in res:
                    rows.append(dict(common, method=method.label, task="passkey", length=L,
                                     depth=r["depth"], value=r["accuracy"], stride="",
                                     scored_tokens=r["trials"], processed_tokens=r["prompt_tokens"],
                                     seconds=m.seconds,
                                     tokens_per_s=total_tokens / max(m.seconds, 1e-9),
                                     peak_mem_mb=m.peak_bytes / 2**20, mem_kind=m.kind,
                                     answers=" | ".join(a.replace("\n", " ") for a in r["answers"])))
        del model
        _free(device)

    if rank != 0:  # rank 0 writes the results of a sequence-parallel run
        return {"markdown": "", "files": {}, "notes": notes, "rows": rows}
    out = report.write_eval_report(rows, cfg.out_dir, notes=notes, plots=cfg.plots,
                                   title=f"{model_name} on {device.type} ({common['dtype']})")
    out["notes"] = notes
    out["rows"] = rows
    return out


def _init_distributed(device) -> None:
    """Join the process group that ``torchrun`` / ``accelerate launch`` describe in the
    environment (NCCL on CUDA, gloo on CPU), unless one exists already."""
    dist = torch.distributed
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)


def _sp_perplexity(model, tokens, L, stride, topo, pattern, bar):
    from .perplexity import PerplexityResult, strided_windows

    device = next(model.parameters()).device
    nll, scored_total, processed, windows = 0.0, 0, 0, 0
    for begin, end, scored in strided_windows(int(tokens.numel()), L, stride):
        nll += _sp_window_nll(model, tokens[begin:end].unsqueeze(0).to(device), scored, topo,
                              pattern)
        scored_total += scored
        processed += end - begin
        windows += 1
        bar.update(1)
    return PerplexityResult(L, stride, nll, scored_total, processed, windows)


def _validate(cfg: EvalConfig) -> None:
    check_eval_grid(cfg.tasks, ("perplexity", "passkey"), cfg.lengths, cfg.passkey_lengths,
                    cfg.depths, cfg.trials)
    if cfg.stride is not None and cfg.stride < 1:
        raise ValueError(f"stride must be >= 1, got {cfg.stride}")
    if cfg.stride is not None and cfg.stride >= min(cfg.lengths):
        raise ValueError(f"stride must be < every length (shortest {min(cfg.lengths)}), "
                         f"got {cfg.stride}")
    if cfg.ppl_tokens < 2:
        raise ValueError(f"ppl_tokens must be >= 2, got {cfg.ppl_tokens}")
    if cfg.sp_size < 1:
        raise ValueError(f"sp_size must be >= 1, got {cfg.sp_size}")
    for p in cfg.corpus:
        if not Path(p).is_file():
            raise FileNotFoundError(f"corpus file not found: {p}")
    if cfg.model is not None and not Path(cfg.model).exists():
        raise FileNotFoundError(
            f"model path not found: {cfg.model} (give a local directory saved with "
            f"save_pretrained; nothing is downloaded)")


# ----------------------------------------------------------------------------- command line
_length_arg = length_type("context length")


def add_eval_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", nargs="?", default=None,
                   help="local model directory (save_pretrained); omit for the built-in tiny "
                        "random-initialised Llama with a character tokenizer (a CPU smoke run)")
    p.add_argument("--pattern", action="append", dest="patterns", default=None,
                   help="pattern for hilbert_dilated, repeatable: a YAML file, a configs/ name "
                        "(dense, default, longnet_lm, pow2), a built-in name (tiny, dense) or "
                        "inline 'W1,W2:R1,R2'. Default: dense and tiny for the built-in model, "
                        "default for a model path")
    p.add_argument("--no-sdpa", action="store_true", help="do not evaluate the sdpa baseline")
    p.add_argument("--tasks", nargs="+", choices=("perplexity", "passkey"),
                   default=["perplexity", "passkey"])
    p.add_argument("--lengths", nargs="+", type=_length_arg, default=None,
                   help="context lengths for perplexity (and passkey unless --passkey-lengths); "
                        "default 128 256 512 (built-in) or 2k 4k 8k 16k")
    p.add_argument("--stride", type=positive_int, default=None,
                   help="window stride in tokens (default: half of each length)")
    p.add_argument("--ppl-tokens", type=positive_int, default=None,
                   help="tokens of the corpus to score (default 4 × the longest length)")
    p.add_argument("--corpus", nargs="+", default=[],
                   help="local .txt/.jsonl/.parquet files read with `datasets` (default: a "
                        "built-in generated corpus)")
    p.add_argument("--text-field", default="text", help="text column of jsonl/parquet files")
    p.add_argument("--passkey-lengths", nargs="+", type=_length_arg, default=None)
    p.add_argument("--depths", nargs="+", type=depth, default=[0.0, 0.5, 1.0],
                   help="needle depths in [0, 1]")
    p.add_argument("--trials", type=positive_int, default=2, help="passkey prompts per cell")
    p.add_argument("--max-new-tokens", type=positive_int, default=8)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, …")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--out-dir", default="eval_results", help="where results.md/.csv and PNGs go")
    p.add_argument("--sp-size", type=positive_int, default=1,
                   help="sequence-parallel group size for the perplexity windows (needs "
                        "`accelerate launch`/`torchrun` and hf_hilbert_attn.sharding)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return p


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    return EvalConfig(
        model=args.model, patterns=tuple(args.patterns or ()), include_sdpa=not args.no_sdpa,
        tasks=tuple(args.tasks), lengths=tuple(args.lengths or ()), stride=args.stride,
        ppl_tokens=args.ppl_tokens, corpus=tuple(args.corpus), text_field=args.text_field,
        passkey_lengths=tuple(args.passkey_lengths or ()), depths=tuple(args.depths),
        trials=args.trials, max_new_tokens=args.max_new_tokens, device=args.device,
        dtype=args.dtype, out_dir=args.out_dir, sp_size=args.sp_size, seed=args.seed,
        plots=not args.no_plots, progress=not args.no_progress)


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the eval for parsed arguments; turns bad values into ``parser.error`` (exit 2)."""
    cfg = config_from_args(args)
    try:
        # Resolve patterns and validate before any model is built, so mistakes fail fast.
        for p in cfg.patterns:
            resolve_pattern(p)
        _validate(cfg.resolved())
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    try:
        out = run_eval(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not out["files"]:  # a non-zero rank of a sequence-parallel run
        return 0
    print(out["markdown"])
    print(f"\nwrote {', '.join(str(v) for v in out['files'].values())}")
    return 0


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = add_eval_arguments(argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_from_args(args, parser)
