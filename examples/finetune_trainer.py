"""Fine-tune a causal LM with ``transformers.Trainer`` (or TRL's ``SFTTrainer``), dilated attention
and sequence parallelism.

Each sequence is sharded over ``--sp-size`` ranks (ring attention over the group); the rest of the
world is data parallel. With one process this is the plain Trainer.

    # CPU, 1 process, then 2 processes sharing every sequence (gloo): the same losses
    python examples/finetune_trainer.py --data notes.txt --seq-len 128 --max-steps 6 --output-dir runs/t1
    torchrun --nproc_per_node 2 examples/finetune_trainer.py --data notes.txt --seq-len 128 \
        --max-steps 6 --output-dir runs/t2
    # stop and go on: checkpoints every --save-steps, --resume latest continues exactly
    torchrun --nproc_per_node 2 examples/finetune_trainer.py ... --resume latest
    # documents packed into rows without padding (DataCollatorWithFlattening), or TRL's SFTTrainer
    torchrun --nproc_per_node 2 examples/finetune_trainer.py ... --packing documents
    torchrun --nproc_per_node 2 examples/finetune_trainer.py ... --trainer sft
    # GPUs: 8 ranks, sequences of 64K tokens over 4 of them, 2 data-parallel groups
    accelerate launch --num_processes 8 --multi_gpu --mixed_precision bf16 \
        examples/finetune_trainer.py --model DIR --data corpus/ --seq-len 65536 --sp-size 4

Without ``--model`` a tiny random Llama (hidden 64, 2 layers) with a character tokenizer is built;
without ``--data`` a generated corpus is used. ``--data``: a ``.txt`` file or a directory of them
(each file one document) or a ``.jsonl`` file (``--text-column``). ``--packing blocks`` joins the
documents with EOS and cuts ``--seq-len`` blocks; ``--packing documents`` packs whole documents
(cut at ``--seq-len``) ``--batch-size`` to a row, positions restarting per document.
``OUTPUT_DIR/train_log.jsonl`` gets every step's loss (full precision), ``OUTPUT_DIR/final`` the
model (its ``config.json`` keeps ``hilbert_attn``) and the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

try:
    import hf_hilbert_attn
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hf_hilbert_attn
from hf_hilbert_attn.sharding import DEFAULT_LAYOUT, LAYOUT_CHOICES


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # under torchrun every rank parses the same arguments: one of them reports
        if os.environ.get("RANK", "0") == "0":
            super().error(message)
        sys.exit(2)


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local model directory (default: a tiny random Llama)")
    p.add_argument("--data", help=".txt file, directory of .txt files, or .jsonl (default: generated)")
    p.add_argument("--text-column", default="text", help="the text field of .jsonl records")
    p.add_argument("--pattern", default=None,
                   help="pattern YAML or shipped name (default: the model's, else the package default)")
    p.add_argument("--trainer", choices=("trainer", "sft"), default="trainer",
                   help="transformers.Trainer, or TRL's SFTTrainer (needs `pip install trl`)")
    p.add_argument("--packing", choices=("blocks", "documents"), default="blocks")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block / per document")
    p.add_argument("--sp-size", type=int, default=None,
                   help="ranks per sequence (default: all processes)")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default=DEFAULT_LAYOUT,
                   help="how a sequence is cut over the group")
    p.add_argument("--batch-size", type=int, default=1, help="rows per data-parallel group per step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--output-dir", default="runs/finetune_trainer")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "grad_accum", "max_steps"):
        if getattr(args, name) < (2 if name == "seq_len" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'seq_len' else 1}, "
                    f"got {getattr(args, name)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.sp_size is not None and (args.sp_size < 1 or world % args.sp_size):
        p.error(f"--sp-size {args.sp_size} must divide the number of processes ({world})")
    if args.model and not Path(args.model).is_dir():
        p.error(f"--model: no such directory: {args.model}")
    if args.data and not Path(args.data).exists():
        p.error(f"--data not found: {args.data}")
    return args


def load_texts(path, column):
    """The documents: each ``.txt`` file whole, or each ``.jsonl`` record's ``column``."""
    from hf_hilbert_attn.tools.evaluation.corpus import builtin_corpus

    if path is None:
        return builtin_corpus(60_000, seed=0)
    path = Path(path)
    files = sorted(f for f in path.iterdir() if f.suffix == ".txt") if path.is_dir() else [path]
    if all(f.suffix == ".jsonl" for f in files):
        docs = [json.loads(line)[column] for f in files for line in f.read_text().splitlines()
                if line.strip()]
    elif all(f.suffix == ".txt" for f in files):
        docs = [f.read_text(encoding="utf-8") for f in files]
    else:
        raise ValueError(f"--data needs .txt files or a .jsonl file, got {[str(f) for f in files]}")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"--data {path}: no text")
    return docs


def build_rows(docs, tok, args):
    """Training rows: ``blocks`` → ``{"input_ids", "labels"}`` of ``seq_len`` tokens;
    ``documents`` → ``{"input_ids"}`` of one document (or a ``seq_len`` piece of one)."""
    ids = [d + [tok.eos_token_id] for d in tok(docs, add_special_tokens=False)["input_ids"]]
    n = args.seq_len
    if args.packing == "documents":
        return [{"input_ids": d[i:i + n]} for d in ids for i in range(0, len(d), n) if len(d[i:i + n]) > 1]
    flat = [t for d in ids for t in d]
    if len(flat) < n:
        raise ValueError(f"the corpus has {len(flat)} tokens, fewer than --seq-len {n}")
    return [{"input_ids": flat[i:i + n], "labels": flat[i:i + n]}
            for i in range(0, len(flat) - n + 1, n)]


def build_model(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_hilbert_attn.tools.evaluation.corpus import build_char_tokenizer, build_default_model

    if args.model:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                     attn_implementation="hilbert_dilated")
    else:
        tok = build_char_tokenizer()
        model = build_default_model(tok, seed=args.seed)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    pattern = args.pattern or getattr(model.config, "hilbert_attn", None)
    hf_hilbert_attn.configure(model, pattern)
    model.set_attn_implementation("hilbert_dilated")
    return model, tok


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import (DataCollatorWithFlattening, Trainer, TrainingArguments,
                              default_data_collator)
    from transformers.trainer_utils import get_last_checkpoint

    from hf_hilbert_attn.integrations.trainer import sequence_parallel_trainer

    model, tok = build_model(args)
    rows = build_rows(load_texts(args.data, args.text_column), tok, args)
    out = Path(args.output_dir)
    common = dict(output_dir=str(out), per_device_train_batch_size=args.batch_size,
                  gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
                  max_steps=args.max_steps, logging_steps=1, report_to="none", seed=args.seed,
                  save_strategy="steps" if args.save_steps else "no",
                  save_steps=args.save_steps or 500, use_cpu=not torch.cuda.is_available(),
                  bf16=args.bf16, disable_tqdm=True, lr_scheduler_type="constant")
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        targs = SFTConfig(**common, padding_free=args.packing == "documents", max_length=None)
        base, extra = SFTTrainer, {"processing_class": tok}
        rows = [{"input_ids": r["input_ids"]} for r in rows]
    else:
        targs = TrainingArguments(**common)
        collator = (DataCollatorWithFlattening() if args.packing == "documents"
                    else default_data_collator)
        base, extra = Trainer, {"data_collator": collator}
    if args.trainer == "sft":
        from datasets import Dataset

        rows = Dataset.from_list(rows)
    trainer = sequence_parallel_trainer(base)(model=model, args=targs, train_dataset=rows,
                                              sp_size=args.sp_size, sp_layout=args.layout, **extra)
    resume = None
    if args.resume == "latest":
        resume = get_last_checkpoint(str(out)) if out.is_dir() else None
        if resume is None:
            raise FileNotFoundError(f"--resume latest: no checkpoint-* under {out}")
    elif args.resume:
        resume = args.resume
    topo = trainer.sp_topology
    if trainer.is_world_process_zero():
        print(f"world {topo.dp_size * topo.sp_size} = dp {topo.dp_size} x sp {topo.sp_size}; "
              f"{len(rows)} rows; pattern {hf_hilbert_attn.get_pattern(model.config)}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
        with open(out / "train_log.jsonl", "w") as f:
            for step, loss in losses:
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        print("losses: " + " ".join(f"{s}:{loss:.6f}" for s, loss in losses), flush=True)
    trainer.save_model(str(out / "final"))
    if trainer.is_world_process_zero():
        tok.save_pretrained(out / "final")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError, ImportError) as e:
        # one line, once (every rank raises the same error; rank 0 says it)
        if os.environ.get("RANK", "0") == "0":
            print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
