"""Do sparse heads learn to retrieve when the fine-tune mixes in retrieval examples? (issue 26,
item 5) One real model, one run:

    python examples/benchmarks/retrieval_finetune.py --model DIR --corpus DIR --out DIR

Rows: dense ``sdpa`` (the control); the default pattern; the default pattern with the dense
key/value heads that ``needle_mass`` calibration picks at ``--budget`` (calibrated once, on the
base model). Each is fine-tuned twice from the base weights with ``python -m
hf_hilbert_attn.tools.finetune`` — ``--retrieval-mix 0`` and ``--retrieval-mix F`` — with the
same steps, lr, warm-up, seed and so the same text blocks in the same order (the mixed run replaces
a fraction F of the steps by retrieval steps; their prompts have a seed of their own, never an
evaluated prompt). Every fine-tuned model is then measured: passkey at 2K / 4K / 8K (5 depths x
4, teacher-forced, the quality study's prompts), RULER-style niah_single, niah_multikey,
niah_multivalue and variable_tracking at 4K and 8K (5 depths x 1), perplexity at 4K / 8K on
held-out text (windows every L/2). ``--base`` measures the three base models too.

Writes ``retrieval_finetune.csv`` and ``retrieval_finetune.md`` (rewritten after every model),
the fine-tunes under ``OUT/finetune/<row>_mix<F>/`` (``finetune.log``, ``train_stats.json``) and
the calibration (``calibration.json``); prints a timestamped line per part with its time.
Fine-tunes run ``--jobs`` at a time on the one GPU (a 135M model at 8K leaves it mostly idle;
the step times in ``train_stats.json`` are then those of a shared GPU, not benchmarks), and
finished ones are evaluated while the others train. A rerun with the same ``--out`` keeps the
fine-tunes that finished.

Cost, from the quality study's fine-tunes (SmolLM2-135M, 150 steps at 8K, one H100,
``docs/bench``): 48 s wall dense (0.137 s/step), 62-73 s sparse (0.23-0.25 s/step), each with
~28 s of start-up, 13.7 GB peak. Six run one after the other would take ~6.5 min; ``--jobs 3``
(~41 GB) overlaps the start-ups and the GPU's idle time, and the evaluations (~0.8M tokens
forward per model, ~10 s) overlap the fine-tunes: expect ~4-5 min after the ~20 s start and
calibration. ``--steps 100`` if it must be shorter. ``--smoke``: a tiny random model on the
CPU, every code path in well under a minute.

``--corpus DIR``: ``DIR/train/*.txt`` is the fine-tune data (each file one document);
``DIR/heldout/*.txt`` the perplexity text.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

# The dense rows run sdpa on a model whose config may hold a pattern: on purpose.
warnings.filterwarnings("ignore", message=".*has a 'hilbert_attn' pattern but the model runs sdpa")

try:
    import hf_hilbert_attn  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_hilbert_attn as H
from hf_hilbert_attn.tools.evaluation.calibrate import calibrate
from hf_hilbert_attn.tools.evaluation.corpus import tokenize_corpus
from hf_hilbert_attn.tools.evaluation.quality_data import read_documents
from hf_hilbert_attn.tools.evaluation.report import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import retrieval_study as shared  # noqa: E402  (the row evaluation, log, lengths)
from retrieval_study import DEPTHS, _k, log  # noqa: E402

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
ROWS = ("dense", "default", "calibrated")
PACKAGE_PARENT = Path(H.__file__).resolve().parents[1]


def settings(args) -> dict:
    if args.smoke:  # a tiny random model on the CPU: every code path, tiny lengths
        return dict(passkey=(256,), passkey_trials=1, passkey_depths=(0.5,), ruler=(512,),
                    ruler_depths=(0.5,), ruler_trials=1, ppl=(256,), ppl_tokens=2048, cal_lengths=(512,), cal_depths=(0.5,),
                    density_length=4096, batch_tokens=4096, seq_len=512, steps=4, warmup=0,
                    lr=1e-3, budget=0.25)  # 2 of the tiny model's 8 kv heads
    return dict(passkey=tuple(args.passkey_lengths), passkey_trials=4, passkey_depths=DEPTHS,
                ruler=tuple(args.ruler_lengths), ruler_depths=DEPTHS, ruler_trials=1,
                ppl=tuple(args.ppl_lengths),
                ppl_tokens=args.ppl_tokens, cal_lengths=None, cal_depths=None,
                density_length=65536, batch_tokens=args.batch_tokens, seq_len=args.seq_len,
                steps=args.steps, warmup=args.warmup, lr=args.lr, budget=args.budget)


# ----------------------------------------------------------------------------- model dirs
def model_copy(src: Path, dst: Path, hilbert_attn) -> Path:
    """``dst``: ``src``'s files (symlinked: the same weights, bit for bit) with ``config.json``'s
    ``hilbert_attn`` set to ``hilbert_attn`` (None: removed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        link = dst / f.name
        if f.is_file() and f.name != "config.json" and not link.exists():
            link.symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("hilbert_attn", None)
    if hilbert_attn is not None:
        cfg["hilbert_attn"] = hilbert_attn
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst


def prepare_models(args, cfg, out: Path, device, dtype, need=("default", "calibrated")) -> dict:
    """The base model directories: dense (the model as given, run with sdpa), default (the base
    pattern, no dense heads) and calibrated (plus the needle_mass choice), as ``need`` asks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(args.model).resolve()
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype,
                                                 attn_implementation="hilbert_dilated")
    base = H.get_pattern(model.config).replace(dense_kv_heads=[])
    H.configure(model, base, keep_dense_heads=False)
    log(f"base pattern (rows default and calibrated): {base}")
    dirs = {"dense": src, "default": model_copy(src, out / "models" / "default", base.to_dict())}
    cal_dir = out / "models" / "calibrated"
    if "calibrated" not in need:
        pass
    elif (cal_dir / "config.json").is_file() and (out / "calibration.json").is_file():
        log(f"calibration: kept {cal_dir}")
    else:
        model.to(device).eval()
        kw = {} if cfg["cal_lengths"] is None else dict(lengths=cfg["cal_lengths"],
                                                        depths=cfg["cal_depths"])
        res = calibrate(model, tok, budget=cfg["budget"], method="needle_mass",
                        max_batch_tokens=cfg["batch_tokens"],
                        density_length=cfg["density_length"], progress=False, **kw)
        log(f"calibration: {res.seconds:.1f} s\n{res.summary()}")
        model_copy(src, cal_dir, model.config.hilbert_attn)
        (out / "calibration.json").write_text(json.dumps(res.to_dict(), indent=1) + "\n")
    dirs["calibrated"] = cal_dir
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dirs


# ----------------------------------------------------------------------------- fine-tunes
class FineTune:
    """One ``python -m hf_hilbert_attn.tools.finetune`` run, as a subprocess."""

    def __init__(self, row: str, mix: float, model_dir: Path, args, cfg, out: Path):
        self.row, self.mix = row, mix
        self.label = f"{row}_mix{mix:g}"
        self.dir = out / "finetune" / self.label
        self.final = self.dir / "final"
        self.proc, self.t0, self.seconds = None, None, None
        self.cmd = [sys.executable, "-m", "hf_hilbert_attn.tools.finetune",
                    "--model", str(model_dir),
                    "--data", str((Path(args.corpus) / "train").resolve()),
                    "--attn-implementation", "sdpa" if row == "dense" else "hilbert_dilated",
                    "--seq-len", str(cfg["seq_len"]), "--max-steps", str(cfg["steps"]),
                    "--lr", repr(float(cfg["lr"])), "--warmup-steps", str(cfg["warmup"]),
                    "--seed", str(args.seed), "--save-every", "0", "--log-every", "1",
                    "--retrieval-mix", repr(float(mix)), "--output-dir", str(self.dir)]
        self.cmd += shlex.split(args.finetune_args)

    def done(self) -> bool:
        return (self.dir / "train_stats.json").is_file() and (self.final / "config.json").is_file()

    def start(self, device) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "command.txt").write_text(shlex.join(self.cmd) + "\n")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_PARENT),
                                                            os.environ.get("PYTHONPATH")])))
        if device.type == "cpu":
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        self.log = open(self.dir / "finetune.log", "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def poll(self):
        """None while it runs; then "" (success) or the error, one line."""
        if self.proc.poll() is None:
            return None
        self.log.close()
        self.seconds = time.perf_counter() - self.t0
        if self.proc.returncode != 0 or not self.done():
            tail = (self.dir / "finetune.log").read_text().strip().splitlines()[-2:]
            return (f"fine-tune {self.label} failed (exit {self.proc.returncode}): "
                    + " | ".join(tail) + f" — log: {self.dir / 'finetune.log'}")
        return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def summary(self) -> dict:
        """What the report shows of ``train_stats.json``."""
        s = json.loads((self.dir / "train_stats.json").read_text())
        return dict(mix=self.mix, steps=s["steps"], seconds_per_step=s["seconds_per_step"],
                    first_step_seconds=s["first_step_seconds"] or 0.0,
                    retrieval_blocks=s["retrieval_blocks"], text_loss=s["text_loss_mean10"],
                    retrieval_loss=s["retrieval_loss_mean10"])

    def describe(self) -> str:
        s = self.summary()
        f = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        took = f"{self.seconds:.0f} s wall, " if self.seconds else "kept, "
        return (f"fine-tune {self.label}: {took}{s['steps']} steps at "
                f"{s['seconds_per_step']:.3f} s/step (first {s['first_step_seconds']:.1f} s); "
                f"{s['retrieval_blocks']} retrieval blocks; loss text {f(s['text_loss'])}, "
                f"retrieval {f(s['retrieval_loss'])} (means of the last 10)")


# ----------------------------------------------------------------------------- evaluation
def evaluate(model_dir: Path, row: str, label: str, stage: str, mix, tok, cfg, tokens, device,
             dtype, rows: list) -> None:
    """Passkey, RULER and perplexity of one model directory (the study's row evaluation);
    appends to ``rows``."""
    from transformers import AutoModelForCausalLM

    impl = "sdpa" if row == "dense" else "hilbert_dilated"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                 attn_implementation=impl).to(device).eval()
    shared.evaluate_row(model, tok, cfg, tokens, None, label, rows,
                       dict(row=row, stage=stage, mix=mix), tasks=RULER_TASKS)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report
FIELDS = ["method", "row", "stage", "mix", "task", "length", "value", "n", "correct", "density",
          "steps", "seconds_per_step", "first_step_seconds", "retrieval_blocks", "text_loss",
          "retrieval_loss"]


def write_report(rows: list, train: dict, out: Path, cfg: dict, notes: list) -> None:
    for r in rows:
        r.update(train.get(r["method"], {}))
    shared.write_csv(out / "retrieval_finetune.csv", FIELDS, rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    val = {(r["method"], r["task"], r["length"]): r for r in rows}
    first = {m: next(r for r in rows if r["method"] == m) for m in methods}
    dense = {(r["stage"], r["mix"]): m for m, r in first.items() if r["row"] == "dense"}
    control = {m: dense.get((r["stage"], r["mix"])) for m, r in first.items()}  # same stage, mix

    def ppl(m, L):
        v, d = val.get((m, "perplexity", L)), val.get((control[m], "perplexity", L))
        if v is None:
            return ""
        if d is None or control[m] in (None, m):
            return f"{v['value']:.3f}"
        return f"{v['value']:.3f} ({v['value'] / d['value']:.3f}x)"

    head = ["model", "mix", f"pairs @{_k(cfg['density_length'])}"]
    head += [f"passkey {_k(L)}" for L in cfg["passkey"]]
    head += [f"RULER mean {_k(L)}" for L in cfg["ruler"]]
    head += [f"ppl {_k(L)}" for L in cfg["ppl"]]
    body = []
    for m in methods:
        r0 = first[m]
        line = [m, r0["mix"], f"{r0['density']:.1%}"]
        for L in cfg["passkey"]:
            r = val.get((m, "passkey", L))
            line.append(f"{r['correct']}/{r['n']}" if r else "")
        for L in cfg["ruler"]:
            vs = [val[(m, t, L)]["value"] for t in RULER_TASKS if (m, t, L) in val]
            line.append(f"{sum(vs) / len(vs):.2f}" if vs else "")
        line += [ppl(m, L) for L in cfg["ppl"]]
        body.append(line)
    tasks_head = ["model"] + [f"{t} {_k(L)}" for L in cfg["ruler"] for t in RULER_TASKS]
    tasks_body = [[m] + [f"{val[(m, t, L)]['value']:.2f}" if (m, t, L) in val else ""
                         for L in cfg["ruler"] for t in RULER_TASKS] for m in methods]
    ft_head = ["fine-tune", "steps", "s/step (shared GPU)", "retrieval blocks",
               "text loss (last 10)", "retrieval loss (last 10)"]
    f = lambda x: "" if x is None else f"{x:.4f}"  # noqa: E731
    ft_body = [[m, t["steps"], f"{t['seconds_per_step']:.3f}", t["retrieval_blocks"],
                f(t["text_loss"]), f(t["retrieval_loss"])] for m, t in train.items()]
    text = ["# Fine-tuning with retrieval examples", "", *notes, "",
            "ppl ratios are to the dense control of the same stage and mix.", "",
            markdown_table(head, body), "", "## RULER-style tasks (fraction of items recalled)",
            "", markdown_table(tasks_head, tasks_body), "", "## Fine-tunes", "",
            markdown_table(ft_head, ft_body), ""]
    (out / "retrieval_finetune.md").write_text("\n".join(text))


# ----------------------------------------------------------------------------- main
class Study:
    """The run's state: what is measured (``rows``), how each fine-tune went (``train``), the
    times of its parts and what failed (one model's failure does not lose the others)."""

    def __init__(self, args, cfg, out: Path, tok, tokens, device, dtype, notes):
        self.args, self.cfg, self.out, self.tok, self.tokens = args, cfg, out, tok, tokens
        self.device, self.dtype, self.notes = device, dtype, notes
        self.rows, self.train, self.timings, self.failed = [], {}, {}, []

    def report(self) -> None:
        write_report(self.rows, self.train, self.out, self.cfg, self.notes + [
            "times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in self.timings.items())])

    def evaluate(self, model_dir, row, label, stage, mix) -> None:
        t = time.perf_counter()
        try:
            evaluate(model_dir, row, label, stage, mix, self.tok, self.cfg, self.tokens,
                     self.device, self.dtype, self.rows)
        except Exception as e:  # noqa: BLE001 (the other models' rows are still worth having)
            self.failed.append(f"eval {label}: {type(e).__name__}: {e}")
            log(self.failed[-1])
        key = "eval base" if stage == "base" else "eval"
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t
        self.report()

    def fine_tune(self, jobs) -> None:
        """Run ``jobs`` (:class:`FineTune`) ``--jobs`` at a time; evaluate each finished one
        while the others train."""
        pending = [j for j in jobs if not j.done()]
        finished = [j for j in jobs if j.done()]
        for j in finished:
            log(j.describe())
        log(f"fine-tunes: {len(pending)} to run ({len(finished)} kept), {self.args.jobs} at a "
            f"time")
        running, t0 = [], time.perf_counter()
        try:
            while pending or running or finished:
                while pending and len(running) < self.args.jobs:
                    j = pending.pop(0)
                    j.start(self.device)
                    running.append(j)
                    log(f"started fine-tune {j.label}")
                for j in list(running):
                    err = j.poll()
                    if err is None:
                        continue
                    running.remove(j)
                    if err:
                        self.failed.append(err)
                        log(err)
                    else:
                        finished.append(j)
                        log(j.describe())
                if not (pending or running) and "fine-tunes" not in self.timings:
                    self.timings["fine-tunes"] = time.perf_counter() - t0
                if finished:
                    j = finished.pop(0)
                    self.train[j.label] = j.summary()
                    self.evaluate(j.final, j.row, j.label, "finetuned", j.mix)
                elif running:
                    time.sleep(1.0)
        finally:  # an interrupted run leaves no fine-tune holding the GPU
            for j in running:
                j.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="retrieval_finetune.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (save_pretrained layout)")
    p.add_argument("--corpus", help="text directory with train/ and heldout/ (*.txt)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=150, help="fine-tune steps (default 150)")
    p.add_argument("--seq-len", type=int, default=8192, help="fine-tune length (default 8192)")
    p.add_argument("--mix", type=float, default=0.25,
                   help="--retrieval-mix of the mixed fine-tunes (default 0.25)")
    p.add_argument("--budget", type=float, default=0.1,
                   help="dense kv-head budget of the calibrated row (default 0.1)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps (the quality study's)")
    p.add_argument("--seed", type=int, default=0, help="fine-tune data order seed")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--jobs", type=int, default=3, help="fine-tunes at a time on the GPU")
    p.add_argument("--base", action="store_true", help="also evaluate the base models")
    p.add_argument("--finetune-args", default="",
                   help="more arguments for hf_hilbert_attn.tools.finetune, one string")
    p.add_argument("--ppl-tokens", type=int, default=65536, help="held-out tokens scored")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per eval forward")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--ruler-lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--ppl-lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model and tiny lengths on the CPU (tests the script)")
    args = p.parse_args(argv)
    if not 0.0 < args.mix < 1.0:
        p.error(f"--mix must be in (0, 1), got {args.mix:g}")
    if args.jobs < 1 or args.steps < 1:
        p.error("--jobs and --steps must be >= 1")
    out = Path(args.out).resolve()
    device, dtype = shared.setup(args, p, out)
    cfg = settings(args)

    from transformers import AutoTokenizer

    corpus = Path(args.corpus)
    held = read_documents(corpus / "heldout")
    read_documents(corpus / "train")  # a missing train/ is said now, not by every fine-tune
    tok = AutoTokenizer.from_pretrained(str(args.model))
    tokens = tokenize_corpus(tok, held, cfg["ppl_tokens"])
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    notes = [f"model `{args.model}`, eval {dtype}, {dev_name}; fine-tunes: {cfg['steps']} steps "
             f"at {cfg['seq_len']} tokens, lr {cfg['lr']:g}, warm-up {cfg['warmup']}, seed "
             f"{args.seed}, retrieval mix 0 vs {args.mix:g} (tasks passkey niah_single "
             f"niah_multikey niah_multivalue), {args.jobs} at a time; calibrated row: "
             f"needle_mass at budget {cfg['budget']:g}; held-out tokens {tokens.numel()}",
             f"command: `python examples/benchmarks/retrieval_finetune.py {cmd}`"]
    log(notes[0])
    study = Study(args, cfg, out, tok, tokens, device, dtype, notes)
    t = time.perf_counter()
    dirs = prepare_models(args, cfg, out, device, dtype, [r for r in args.rows if r != "dense"])
    study.timings["calibrate"] = time.perf_counter() - t
    if args.base:
        for row in args.rows:
            study.evaluate(dirs[row], row, f"{row} base", "base", "")
    study.fine_tune([FineTune(row, mix, dirs[row], args, cfg, out) for mix in (0.0, args.mix)
                     for row in args.rows])
    study.report()
    log("times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in study.timings.items())
        + " (eval overlaps the fine-tunes)")
    for f in study.failed:
        log(f"FAILED: {f}")
    log(f"wrote {out / 'retrieval_finetune.csv'} and {out / 'retrieval_finetune.md'}")
    print((out / "retrieval_finetune.md").read_text())
    return 1 if study.failed else 0


if __name__ == "__main__":
    sys.exit(main())
