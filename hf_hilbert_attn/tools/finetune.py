"""Fine-tune a causal LM with dilated attention and sequence parallelism.

Each sequence of ``--seq-len`` tokens is sharded over ``--sp-size`` ranks (ring attention over
the group); the remaining factor of the world is data parallel (DDP through Accelerate).

    # CPU, 2 processes, sequence parallel over both (gloo)
    accelerate launch --config_file configs/accelerate/sp2_cpu.yaml examples/finetune.py \
        --seq-len 512 --max-steps 20 --output-dir runs/tiny
    torchrun --nproc_per_node 2 examples/finetune.py --seq-len 512 --max-steps 20 \
        --output-dir runs/tiny
    # resume from the latest checkpoint (exact: data order, RNG, optimizer, scheduler)
    torchrun --nproc_per_node 2 examples/finetune.py ... --resume latest
    # 8 GPUs, sequences of 256K tokens over 4 GPUs each, 2 data-parallel groups
    accelerate launch --config_file configs/accelerate/sp8_gpu.yaml examples/finetune.py \
        --model /path/to/llama --data corpus.jsonl --seq-len 262144 --sp-size 4

    # the dense control of a quality study: same data order, steps and lr, plain SDPA attention
    python examples/finetune.py --model DIR --data corpus/train --attn sdpa \
        --seq-len 8192 --max-steps 150 --save-every 0 --output-dir runs/sdpa
    # the pattern: a shipped name, a YAML file or inline segment lengths : dilation rates
    python examples/finetune.py --model DIR --data corpus/train --pattern 2048,8192:1,4:sinks=1

Without ``--model`` a tiny Llama (hidden 64, 2 layers, byte vocabulary) is built from a config;
without ``--data`` a generated corpus is used. Data: a ``.txt`` file or a directory of them (each
FILE is one document, read whole, files in name order), or ``.jsonl``/``.json``/``.parquet``
files loaded with ``datasets`` (one document per record of ``--text-field``); documents are
joined with EOS, packed
into ``--seq-len`` blocks and visited in an order that depends only on ``--seed`` (the same for
every attention implementation). Mixed precision: bf16 autocast on CUDA unless the launcher
(``accelerate launch --mixed_precision``) or ``--mixed-precision`` says otherwise; weights and
optimizer stay float32. The final model (``OUTPUT_DIR/final``) has the tokenizer beside it and
keeps the pattern in its ``config.json`` (``hilbert_attn``); ``OUTPUT_DIR/train_stats.json``
holds the steps, seconds per step and tokens/s (both without the first step) and the final loss.
The default learning rate, 1e-4, suits fine-tuning a pretrained model (1e-3 diverged on
SmolLM2-135M); raise it for the tiny random model.

Retrieval mix (issue 26): ``--retrieval-mix F`` makes a fraction F of the steps retrieval steps
(spread evenly, phase set by ``--seed``; every row of such a step is one): RULER-style prompts of
exactly ``--seq-len`` tokens (``--retrieval-tasks``, depths uniform in [0, 1], a seed of their
own, never an evaluated prompt) with the answer and EOS at the end and the loss on the answer
tokens only (:mod:`hf_hilbert_attn.tools.evaluation.retrieval_train`). The text steps see the same
text blocks in the same order as a run without the mix, fewer of them. A retrieval step's loss
is the mean over its answer tokens, so it weighs as much as a text step; it is logged in
``train_log.jsonl`` with ``"retrieval": 1``. Bad arguments and inputs print one line,
``finetune.py: error: ...`` (from rank 0 only under a launcher), and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

import hf_hilbert_attn
from hf_hilbert_attn import patterns
from hf_hilbert_attn.integrations.model_config import sharding_pattern
from hf_hilbert_attn.integrations.accelerate import (
    reduce_loss, sequence_parallel_topology, shard_for_sequence_parallel)
from hf_hilbert_attn.long_context import offload_checkpoints, tile_mlp
from hf_hilbert_attn.sharding import DEFAULT_LAYOUT, LAYOUT_CHOICES
from hf_hilbert_attn.training import LOSS_BACKENDS, enable_checkpointing

from .evaluation._args import (InputError, InputNotFound, missing_extra,
                             quiet_libraries_if_redirected, resolve_pattern, show_progress)
from .finetune_data import ByteTokenizer, RetrievalMix, load_texts, pack, step_batch
from .models import MODEL_SHAPES, CausalLMWithLoss, compile_layers

logger = logging.getLogger("finetune")
PROG = "finetune.py"


class _Parser(argparse.ArgumentParser):
    """Argument errors become :class:`InputError`: one line, printed by rank 0 only (see main)."""

    def error(self, message):
        raise InputError(message)


def parse_args(argv=None):
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local model path (default: a tiny built-in Llama)")
    p.add_argument("--model-preset", choices=("1b",), default=None,
                   help="random-initialised model of a preset shape instead of --model "
                   "(1b: Llama-3.2-1B shape, the one of `hf-hilbert-attn bench model --preset 1b`)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="cross-entropy over N positions at a time from the final hidden states "
                   "(the [S, vocab] logits are never whole); 0: the model's own loss")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: --model; a byte tokenizer without either)")
    p.add_argument("--data", help=".txt file or directory of .txt files (each file one document), "
                   "or jsonl/json/parquet file(s) (default: generated)")
    p.add_argument("--text-field", default="text",
                   help="text column of jsonl/json/parquet data (the eval's flag of that name)")
    p.add_argument("--text-column", dest="text_field", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--attn", "--attn-implementation", dest="attn_implementation",
                   choices=("hilbert_dilated", "sdpa"), default="hilbert_dilated",
                   help="sdpa: plain dense attention, the control of a quality study (--pattern "
                   "is then ignored; no sequence parallelism)")
    p.add_argument("--pattern", default=None,
                   help="a shipped pattern name (default, longnet_lm, ...), a YAML file or inline "
                   "'W1,W2:R1,R2[:sliding][:sinks=K]', as the eval takes (default: the model's "
                   "config, else the shipped default)")
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16", "fp16"), default="auto",
                   help="autocast dtype; auto: the launcher's choice under `accelerate launch`, "
                   "else bf16 on CUDA and none on CPU")
    p.add_argument("--cpu", action="store_true",
                   help="train on the CPU where a GPU is present too (processes talk over gloo), "
                   "as `accelerate launch --cpu`")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default): float32 weights, gradients and AdamW states under "
                   "autocast, the quality setting; bfloat16: all three in bf16, half the memory "
                   "(capacity runs at extreme lengths)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every decoder layer (regional compilation; the first "
                   "step absorbs it): fused norms and activations, less memory per layer")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--sp-size", type=int, default=None,
                   help="ranks per sequence (default: all processes)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default=DEFAULT_LAYOUT,
                   help="sequence layout over the group (auto: contiguous when shards are whole "
                   "longest segments, else zigzag)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel group")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="peak learning rate (default 1e-4: 1e-3 diverges on a pretrained 135M "
                   "model)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (0: never)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--output-dir", default="runs/finetune",
                   help="checkpoints and the final model (default %(default)s)")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--tiled-mlp", type=int, default=0, metavar="CHUNK",
                   help="run each layer's MLP and norms and their backward CHUNK tokens at a "
                   "time (0: off)")
    p.add_argument("--offload-checkpoints", action="store_true",
                   help="keep the checkpointed layer inputs in host memory (needs "
                   "--gradient-checkpointing)")
    p.add_argument("--retrieval-mix", type=float, default=0.0, metavar="F",
                   help="fraction of the steps that train on synthetic retrieval prompts, the "
                   "loss on the answer only (0 <= F < 1; default 0)")
    p.add_argument("--retrieval-tasks", nargs="+", default=None, metavar="TASK",
                   help="tasks of the retrieval steps, cycled (default: passkey niah_single "
                   "niah_multikey niah_multivalue; any of tools.evaluation.ruler's)")
    p.add_argument("--loss-backend", choices=LOSS_BACKENDS, default="auto",
                   help="with --loss-chunk > 0: liger (Liger-Kernel's fused linear cross-entropy, "
                   "CUDA), chunked, or auto (liger where installed on CUDA)")


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Refuse bad combinations and values (one line each), resolve the pattern and the tasks."""
    if args.model and args.model_preset:
        p.error("--model and --model-preset exclude each other")
    if args.tiled_mlp < 0:
        p.error(f"--tiled-mlp must be >= 0 (0: off), got {args.tiled_mlp}")
    if args.offload_checkpoints and not args.gradient_checkpointing:
        p.error("--offload-checkpoints needs --gradient-checkpointing")
    if args.loss_chunk < 0:
        p.error(f"--loss-chunk must be >= 0, got {args.loss_chunk}")
    if args.seq_len < 2:
        p.error(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.attn_implementation == "sdpa" and args.sp_size not in (None, 1):
        p.error(f"--attn-implementation sdpa cannot shard a sequence (--sp-size {args.sp_size}); "
                "use --sp-size 1")
    for flag in ("model", "tokenizer", "data"):
        path = getattr(args, flag)
        if path is not None and not Path(path).exists():
            raise InputNotFound(f"--{flag} {path}: path not found (local files only; nothing is "
                                f"downloaded)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.sp_size is not None and (args.sp_size < 1 or world % args.sp_size):
        p.error(f"--sp-size {args.sp_size} must divide the number of processes ({world})" + (
            "; start it with `torchrun --nproc_per_node N` or `accelerate launch --multi_gpu "
            "--num_processes N` (the flag also on CPUs)" if world == 1 else ""))
    for flag in ("batch_size", "max_steps", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.save_every < 0 or args.warmup_steps < 0:
        p.error("--save-every and --warmup-steps must be >= 0")
    if args.pattern is not None and args.attn_implementation != "sdpa":
        args.pattern = resolve_pattern(args.pattern)[1]  # an InputError names a bad one
    if not 0.0 <= args.retrieval_mix < 1.0:
        p.error(f"--retrieval-mix must be a fraction in [0, 1), got {args.retrieval_mix:g}")
    from .evaluation.retrieval_train import TRAIN_TASKS, check_tasks

    try:
        args.retrieval_tasks = check_tasks(args.retrieval_tasks or TRAIN_TASKS)
    except ValueError as e:
        p.error(f"--retrieval-tasks: {e}")


# ---------------------------------------------------------------------------------- model
def build_model(args, tokenizer):
    """The model (float32 weights, mixed precision by autocast, unless ``--weights-dtype
    bfloat16``) and its pattern (None for sdpa)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    impl = args.attn_implementation
    if args.model_preset:
        kw = dict(MODEL_SHAPES[args.model_preset])
        kw["vocab_size"] = max(kw["vocab_size"], tokenizer.vocab_size)
        cfg = LlamaConfig(max_position_embeddings=max(131072, args.seq_len),
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **kw)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    elif args.model:
        try:
            cfg = AutoConfig.from_pretrained(args.model)
        except (OSError, ValueError) as e:  # no config.json, or one of an unknown model type
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InputError(f"--model {args.model}: not a model directory ({first})") from None
        # float32 whatever the checkpoint holds (transformers 5 would load bf16 weights as bf16)
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=impl,
                                                     dtype=torch.float32)
    else:
        cfg = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=max(4096, args.seq_len),
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    if impl == "sdpa":
        pattern = None
    elif args.pattern:
        pattern = args.pattern  # resolved by parse_args
    elif getattr(cfg, "hilbert_attn", None):
        # the shared pattern; a calibration's per-layer dense heads stay in the config
        # (configure keeps them), so a calibrated model trains as the hybrid it is
        pattern = hf_hilbert_attn.get_pattern(cfg)
    else:
        pattern = patterns.default()
    if pattern is not None:
        hf_hilbert_attn.configure(model, pattern)
    if args.gradient_checkpointing:
        enable_checkpointing(model)
    tile_mlp(model, args.tiled_mlp)
    if args.offload_checkpoints:
        offload_checkpoints(model)
    if args.weights_dtype == "bfloat16":
        model.to(torch.bfloat16)
    if args.compile:
        compile_layers(model)
    return model, pattern


class TrainState:
    """Completed optimizer steps; saved with ``accelerator.save_state``."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, d):
        self.step = int(d["step"])


def load_tokenizer(args):
    """The tokenizer of ``--tokenizer`` or ``--model``; the byte tokenizer when neither has one."""
    source = args.tokenizer or args.model
    if source is None:
        return ByteTokenizer()
    files = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")
    if args.tokenizer or any((Path(source) / f).exists() for f in files):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    logger.warning("%s has no tokenizer files: using the byte tokenizer (ids 0-256); pass "
                   "--tokenizer if the model has its own", source)
    return ByteTokenizer()


def resolve_mixed_precision(choice: str, cuda: bool):
    """``--mixed-precision`` for ``Accelerator``: None defers to ``accelerate launch``'s setting
    (it exports ACCELERATE_MIXED_PRECISION); ``auto`` elsewhere is bf16 on CUDA, none on CPU."""
    if choice != "auto":
        return choice
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return None
    return "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"


def latest_checkpoint(out: Path):
    ckpts = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return ckpts[-1] if ckpts else None


def _mean_last(xs, n: int = 10):
    return sum(xs[-n:]) / len(xs[-n:]) if xs else None


def _fmt(x):
    return "n/a" if x is None else f"{x:.4f}"


def main(argv=None):
    """Run the fine-tune; an :class:`InputError` (a bad argument or input) or a missing tool
    package prints one line from rank 0 only and exits with status 2 on every rank
    (``HF_HILBERT_DEBUG=1``: the traceback)."""
    try:
        _main(argv)
    except (InputError, ModuleNotFoundError) as e:
        message = str(e) if isinstance(e, InputError) else missing_extra(e)
        if message is None or os.environ.get("HF_HILBERT_DEBUG", "") not in ("", "0"):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(argv=None):
    args = parse_args(argv)
    from accelerate.utils import set_seed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    quiet_libraries_if_redirected()  # (a log gets train_log.jsonl's lines, no bars)
    accelerator, topo = _accelerator(args)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)

    tokenizer = load_tokenizer(args)
    need = args.seq_len * args.batch_size * topo.dp_size
    docs = load_texts(args.data, args.text_field, need)
    blocks = pack(docs, tokenizer, args.seq_len)
    mix = None
    if args.retrieval_mix > 0:
        mix = RetrievalMix(tokenizer, args.retrieval_mix, args.retrieval_tasks, args.seq_len,
                           args.seed, documents=docs[:200])
        mix.check()
    lm, pattern = build_model(args, tokenizer)
    model = CausalLMWithLoss(lm, args.loss_chunk, loss_backend=args.loss_backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)) if args.warmup_steps else 1.0)
    # The scheduler is not passed through prepare(): Accelerate would step it once per process,
    # which would make the schedule depend on the sequence-parallel degree.
    model, opt = accelerator.prepare(model, opt)
    state = TrainState()
    accelerator.register_for_checkpointing(sched, state)
    if args.resume:
        _resume(args, out, accelerator, state)
    if accelerator.is_main_process:
        _log_start(args, accelerator, topo, blocks, pattern, mix)

    run = _train(args, accelerator, topo, (model, opt, sched), state, blocks, mix, pattern, out)
    stats = _stats(args, accelerator, topo, run, state, mix, pattern)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _save_final(args, accelerator, model, tokenizer, out, stats, run["losses"], mix,
                    args.batch_size * topo.dp_size)
    # every rank leaves together: no rank tears the process group down while another still works
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _accelerator(args):
    """The ``Accelerator`` and the sequence-parallel topology of this run."""
    from accelerate import Accelerator

    # torchrun on a machine without CUDA (or --cpu): Accelerate needs cpu=True to pick MULTI_CPU
    # (gloo)
    cuda_here = torch.cuda.is_available() and not args.cpu
    accelerator = Accelerator(cpu=not cuda_here,
                              mixed_precision=resolve_mixed_precision(args.mixed_precision,
                                                                      cuda_here))
    try:
        topo = sequence_parallel_topology(accelerator, args.sp_size)
    except ValueError as e:  # an --sp-size the world does not allow
        raise InputError(str(e)) from None
    return accelerator, topo


def _resume(args, out: Path, accelerator, state: TrainState) -> None:
    ckpt = latest_checkpoint(out) if args.resume == "latest" else Path(args.resume)
    if ckpt is None or not ckpt.exists():
        raise InputNotFound(f"--resume {args.resume}: no checkpoint "
                            f"{'under ' + str(out / 'checkpoints') if ckpt is None else ckpt}")
    accelerator.load_state(str(ckpt))
    if accelerator.is_main_process:
        logger.info("resumed from %s at step %d", ckpt, state.step)


def _log_start(args, accelerator, topo, blocks, pattern, mix) -> None:
    logger.info("world %d = dp %d x sp %d (%s); %d blocks of %d tokens; %s; layout %s; "
                "mixed precision %s", accelerator.num_processes, topo.dp_size, topo.sp_size,
                topo.source, blocks.shape[0], args.seq_len,
                pattern if pattern is not None else "sdpa (dense)", args.layout,
                accelerator.mixed_precision)
    if args.compile:  # its progress bar shows no step for minutes at 1M+ tokens
        logger.info("--compile: the first step compiles and autotunes the layers (1B shape at 1M "
                    "tokens per GPU on H200s: ~100 s on one GPU, ~300 s with sequence parallelism)")
    if mix is not None:
        logger.info("retrieval mix %g: %d of %d steps are retrieval steps (%d blocks; tasks "
                    "%s)", args.retrieval_mix, mix.schedule.before(args.max_steps),
                    args.max_steps, mix.blocks_in(args.max_steps, args.batch_size
                                                  * topo.dp_size),
                    " ".join(args.retrieval_tasks))


def _train(args, accelerator, topo, training, state: TrainState, blocks, mix, pattern,
           out: Path) -> dict:
    """The steps up to ``--max-steps``: log, checkpoint; returns the losses and the timings."""
    from tqdm.auto import tqdm

    model, opt, sched = training
    # what `auto` shards by: the pattern, with a calibration's per-layer dense heads (D46)
    shard_pattern = None if pattern is None else sharding_pattern(
        accelerator.unwrap_model(model).lm.config)
    tokens_per_step = args.seq_len * args.batch_size * topo.dp_size
    bar = tqdm(total=args.max_steps, initial=state.step, desc="train", unit="step",
               disable=not (accelerator.is_main_process and show_progress()))
    model.train()
    cuda = accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(accelerator.device)
    # tokens/s counts from the end of the first step of this run (planning, autotuning and
    # allocator warm-up fall in it) once a second step exists
    t0, tok0, first_step = time.perf_counter(), 0, state.step + 1
    t_start, first_seconds, losses, kinds = t0, None, [], []
    start_step = state.step
    while state.step < args.max_steps:
        ids, labels, retrieval = step_batch(blocks, state.step, topo.dp_rank, topo.dp_size,
                                            args.batch_size, args.seed, mix)
        ids, labels = ids.to(accelerator.device), labels.to(accelerator.device)
        # labels -100 outside a retrieval block's answer; shard_batch shifts, then shards them
        shard = shard_for_sequence_parallel({"input_ids": ids, "labels": labels}, topo,
                                            layout=args.layout, pattern=shard_pattern)
        with hf_hilbert_attn.sequence_parallel(topo.group):
            loss = reduce_loss(model(**shard), topo.group)
            accelerator.backward(loss)
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        state.step += 1
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        losses.append(mean_loss)
        kinds.append(retrieval)
        if state.step == first_step:
            t0, tok0 = time.perf_counter(), 0
            first_seconds = t0 - t_start
        else:
            tok0 += tokens_per_step
        if state.step % args.log_every == 0 or state.step == args.max_steps:
            _log_step(args, accelerator, state.step, mean_loss, sched,
                      tok0 / (time.perf_counter() - t0) if tok0 else None,
                      retrieval if mix is not None else None, out / "train_log.jsonl", bar)
        bar.update(1)
        if args.save_every and (state.step % args.save_every == 0 or state.step == args.max_steps):
            accelerator.save_state(str(out / "checkpoints" / f"step_{state.step}"))
    t_end = time.perf_counter()
    bar.close()
    return dict(t_start=t_start, t0=t0, t_end=t_end, tok0=tok0, first_seconds=first_seconds,
                losses=losses, kinds=kinds, start_step=start_step, cuda=cuda,
                tokens_per_step=tokens_per_step)


def _log_step(args, accelerator, step: int, loss: float, sched, tokens_per_s, retrieval,
              log_path: Path, bar) -> None:
    """One line of ``train_log.jsonl`` (rank 0 writes it) and the progress bar's numbers."""
    rec = {"step": step, "loss": loss, "lr": sched.get_last_lr()[0],
           "tokens_per_s": tokens_per_s}
    if retrieval is not None:
        rec["retrieval"] = int(retrieval)
    if accelerator.device.type == "cuda":
        peak = torch.tensor(torch.cuda.max_memory_allocated(accelerator.device) / 2**30,
                            device=accelerator.device)
        rec["peak_mem_gib_max_rank"] = accelerator.reduce(peak, reduction="max").item()
    if accelerator.is_main_process:
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        post = {"loss": f"{loss:.4f}"}
        if rec["tokens_per_s"]:  # none yet on the first (warm-up) step
            post["tok_s"] = f"{rec['tokens_per_s']:.0f}"
        bar.set_postfix(post)


def _stats(args, accelerator, topo, run: dict, state: TrainState, mix, pattern) -> dict:
    """The content of ``train_stats.json``."""
    losses, kinds, first_seconds = run["losses"], run["kinds"], run["first_seconds"]
    t_start, t0, t_end, tok0 = run["t_start"], run["t0"], run["t_end"], run["tok0"]
    tokens_per_step = run["tokens_per_step"]
    steps_run = len(losses)
    per_step = args.batch_size * topo.dp_size
    retrieval_blocks = (mix.blocks_in(state.step, per_step)
                        - mix.blocks_in(run["start_step"], per_step) if mix is not None else 0)
    timed_steps = steps_run - 1  # without the first (warm-up) step, when there is another
    return {
        "steps": steps_run, "max_steps": args.max_steps, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "world": accelerator.num_processes,
        "tokens_per_step": tokens_per_step, "seconds": t_end - t_start,
        "first_step_seconds": first_seconds,
        "seconds_per_step": (t_end - t0) / timed_steps if timed_steps > 0 else first_seconds,
        "tokens_per_s": (tok0 / (t_end - t0) if timed_steps > 0
                         else tokens_per_step / first_seconds if first_seconds else None),
        "timing_excludes_first_step": timed_steps > 0,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean10": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "attn_implementation": args.attn_implementation,
        "pattern": pattern.to_dict() if pattern is not None else None,
        "retrieval_mix": args.retrieval_mix,
        "retrieval_tasks": list(args.retrieval_tasks) if mix is not None else None,
        "retrieval_blocks": retrieval_blocks,  # in this run (a resumed one: since the resume)
        "text_loss_mean10": _mean_last([x for x, r in zip(losses, kinds) if not r]),
        "retrieval_loss_mean10": _mean_last([x for x, r in zip(losses, kinds) if r]),
        "mixed_precision": str(accelerator.mixed_precision), "device": str(accelerator.device),
        "peak_mem_gib": (torch.cuda.max_memory_allocated(accelerator.device) / 2**30
                         if run["cuda"] else None),
    }


def _save_final(args, accelerator, model, tokenizer, out: Path, stats: dict, losses, mix,
                per_step: int) -> None:
    """``OUTPUT_DIR/final`` (model + tokenizer), ``train_stats.json`` and the summary lines."""
    final = out / "final"
    lm = accelerator.unwrap_model(model).lm
    lm.save_pretrained(final)
    tokenizer.save_pretrained(final)  # so final/ loads (and evaluates) like any model
    logger.info("saved %s (config.hilbert_attn = %s)", final,
                getattr(lm.config, "hilbert_attn", None))
    steps_run = stats["steps"]
    if steps_run > 0:
        logger.info("%d steps: %.4g s/step, %.4g tokens/s (%s the first step), final loss "
                    "%.4f (mean of the last 10: %.4f)", steps_run, stats["seconds_per_step"],
                    stats["tokens_per_s"],
                    "without" if stats["timing_excludes_first_step"] else "with",
                    losses[-1], stats["final_loss_mean10"])
    if mix is not None:
        logger.info("retrieval mix %g: %d of %d blocks were retrieval examples (mean loss of "
                    "the last 10 retrieval steps %s, of text steps %s)", args.retrieval_mix,
                    stats["retrieval_blocks"], steps_run * per_step,
                    _fmt(stats["retrieval_loss_mean10"]), _fmt(stats["text_loss_mean10"]))
    (out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")


if __name__ == "__main__":
    main()
