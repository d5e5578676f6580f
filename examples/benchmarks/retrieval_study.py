"""Retrieval vs perplexity vs density of sparse patterns with and without calibrated dense
key/value heads (issue 26), on one real model, in one run (about 7 minutes on an H100):

    python examples/benchmarks/retrieval_study.py --model DIR --corpus DIR --out DIR

Rows: dense ``sdpa``; the default pattern; the default pattern with the dense heads chosen by
``needle_mass`` and by ``ablation`` calibration at each ``--budgets`` (one calibration per
method at the largest budget; a smaller budget takes a prefix of its order); patterns that see
every distance without dense heads: ``query_dilation: all`` and the rates capped at the query
heads per key/value head (``cap_g``) or at the query heads (``cap_hq``).

Per row: passkey at 2K / 4K / 8K (5 depths x 4, teacher-forced, the quality study's prompts);
every RULER-style task (``hf_hilbert_attn.tools.evaluation.ruler``) at 4K and 8K (5 depths x
``--ruler-trials``); perplexity at 4K / 8K / 16K on held-out text (windows every L/2); the
causal-pair density at 64K over all layers, dense heads included. Writes ``retrieval.csv``,
``retrieval.md``, ``retrieval_heatmap.png`` and ``calibration_*.json`` into ``--out``; prints
each part's time. ``--smoke`` runs every part on a tiny random model on the CPU (seconds).

It prints its plan in tokens first (default settings, SmolLM2-135M: 13 rows x 1.08M tokens
= 14.1M, and the ablation calibration 144 passes x 74K = 10.6M tokens, all forward only), then
a line per row with each part's time. Shorter: ``--rescore 0`` (ablation 92 passes),
``--budgets 0.1 0.2``, ``--no-coverage``, ``--ppl-tokens 32768``.

``--corpus DIR``: ``DIR/heldout/*.txt`` (else ``DIR/*.txt``) for perplexity; the real-text
haystack of ``niah_single_text`` comes from ``DIR/train/*.txt`` when present (else the same).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import warnings

import torch

# The dense row runs sdpa on a model whose config holds a pattern: on purpose.
warnings.filterwarnings("ignore", message=".*has a 'hilbert_attn' pattern but the model runs sdpa")

try:
    import hf_hilbert_attn  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hf_hilbert_attn as H
from hf_hilbert_attn.tools.evaluation.calibrate import calibrate, model_density
from hf_hilbert_attn.tools.evaluation.corpus import tokenize_corpus
from hf_hilbert_attn.tools.evaluation.passkey import evaluate_passkey_teacher_forced
from hf_hilbert_attn.tools.evaluation.perplexity import perplexity_batched
from hf_hilbert_attn.tools.evaluation.quality_data import read_documents
from hf_hilbert_attn.tools.evaluation.report import markdown_table
from hf_hilbert_attn.tools.evaluation.ruler import TASKS, evaluate_ruler, word_list
from hf_hilbert_attn.tools.evaluation.ruler_report import plot_heatmap, summarize

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _k(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


# ----------------------------------------------------------------------------- settings
def settings(args) -> dict:
    if args.smoke:  # a tiny random model on the CPU: every code path, tiny lengths
        return dict(passkey=(256,), passkey_trials=1, ruler=(512,), ruler_trials=1,
                    ruler_depths=(0.5,), ppl=(256,), ppl_tokens=1024, cal_lengths=(512,),
                    cal_depths=(0.5,), rescore=1, density_length=4096, batch_tokens=4096)
    return dict(passkey=tuple(args.passkey_lengths), passkey_trials=4,
                ruler=tuple(args.ruler_lengths), ruler_trials=args.ruler_trials,
                ruler_depths=DEPTHS, ppl=tuple(args.ppl_lengths), ppl_tokens=args.ppl_tokens,
                cal_lengths=(4096, 8192), cal_depths=tuple(args.cal_depths),
                cal_trials=args.cal_trials, rescore=args.rescore, density_length=65536,
                batch_tokens=args.batch_tokens)


def smoke_assets(root: Path):
    """A tiny random Llama (4 layers, 4 query / 2 kv heads) with a character tokenizer and a
    tiny sliding pattern, and a generated corpus: what --smoke runs on."""
    from hf_hilbert_attn.tools.evaluation.corpus import (build_char_tokenizer, build_default_model,
                                                   builtin_corpus)

    model_dir, corpus = root / "model", root / "corpus"
    tok = build_char_tokenizer()
    model = build_default_model(tok, seed=3, num_hidden_layers=4, max_position_embeddings=4096)
    H.configure(model, H.DilatedPattern([64, 128, 256], [1, 2, 4], sink_tokens=1,
                                        window="sliding"))
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    for part, seed in (("train", 1), ("heldout", 2)):
        (corpus / part).mkdir(parents=True, exist_ok=True)
        for i, doc in enumerate(builtin_corpus(6000, seed=seed)):
            (corpus / part / f"{i:03d}.txt").write_text(doc)
    return model_dir, corpus


# ----------------------------------------------------------------------------- patterns
def capped(pattern, cap: int):
    """``pattern`` with every rate at most ``cap``, less the sliding configs that another then
    covers (a window no shorter whose rate divides theirs)."""
    cfgs = [(w, min(r, cap)) for w, r in zip(pattern.segment_lengths, pattern.dilation_rates)]
    keep = [(w, r) for i, (w, r) in enumerate(cfgs)
            if not any(j != i and w2 >= w and r % r2 == 0 and ((w2, r2) != (w, r) or j < i)
                       for j, (w2, r2) in enumerate(cfgs))]
    return pattern.replace(segment_lengths=[w for w, _ in keep],
                           dilation_rates=[r for _, r in keep])


def coverage_patterns(base, hq: int, hkv: int) -> dict:
    """Patterns where every distance is seen by some head of a layer, without dense heads:
    ``all`` mode (every query uses every config, with its own class), and the rates capped at
    the query heads per kv head (each kv group's heads cover every class) or at the query
    heads (the layer's heads cover every class)."""
    return {"all_mode": base.replace(query_dilation="all"),
            "cap_g": capped(base, hq // hkv), "cap_hq": capped(base, hq)}


def plan(cfg: dict, args, ppl_tokens: int, heads: int) -> str:
    """What the run will process, in tokens (forward only), to read the times against."""
    from hf_hilbert_attn.tools.evaluation.perplexity import strided_windows

    pk = sum(L * len(DEPTHS) * cfg["passkey_trials"] for L in cfg["passkey"])
    ruler = len(TASKS) * len(cfg["ruler_depths"]) * cfg["ruler_trials"] * sum(cfg["ruler"])
    ppl = sum(e - b for L in cfg["ppl"] for b, e, _ in strided_windows(ppl_tokens, L, L // 2))
    rows = 2 + len(args.methods) * len(args.budgets) + (0 if args.no_coverage else 3)
    cal = 2 * len(cfg["cal_depths"]) * cfg.get("cal_trials", 1) * sum(cfg["cal_lengths"])
    k = int(max(args.budgets) * heads + 1e-9)
    passes = 2 + heads + max(0, k - 1) * cfg["rescore"] if "ablation" in args.methods else 0
    return (f"plan: {rows} rows x (passkey {pk / 1e3:.0f}K + RULER {ruler / 1e3:.0f}K + "
            f"perplexity {ppl / 1e3:.0f}K tokens) = {rows * (pk + ruler + ppl) / 1e6:.1f}M tokens; "
            f"ablation calibration {passes} passes x {cal / 1e3:.0f}K = "
            f"{passes * cal / 1e6:.1f}M tokens")


# ----------------------------------------------------------------------------- one row
def evaluate_row(model, tok, cfg, tokens, documents, row: str, rows: list, meta: dict, *,
                 tasks=TASKS) -> None:
    """Passkey, RULER ``tasks`` and perplexity of the model as configured; appends to ``rows``
    one dict per measurement, carrying ``meta`` (also examples/benchmarks/retrieval_finetune.py)."""
    dense = model.config._attn_implementation == "sdpa"
    density = 1.0 if dense else model_density(model.config, cfg["density_length"])
    common = dict(meta, method=row, density=density)
    t = time.perf_counter()
    passkey = []
    for L in cfg["passkey"]:
        res = evaluate_passkey_teacher_forced(model, tok, L, cfg.get("passkey_depths", DEPTHS),
                                              cfg["passkey_trials"], seed=0,
                                              max_batch_tokens=cfg["batch_tokens"])
        correct, n = sum(r["correct"] for r in res), sum(r["trials"] for r in res)
        passkey.append(f"{correct}/{n}")
        rows.append(dict(common, task="passkey", length=L, value=correct / n, n=n,
                         correct=correct))
    t_pk, t = time.perf_counter() - t, time.perf_counter()
    res = evaluate_ruler(model, tok, tasks=tasks, lengths=cfg["ruler"],
                         depths=cfg["ruler_depths"], trials=cfg["ruler_trials"], seed=0,
                         documents=documents, max_batch_tokens=cfg["batch_tokens"])
    ruler = summarize(res)
    for s in ruler:
        rows.append(dict(common, task=s["task"], length=s["length"], value=s["score"], n=s["n"]))
    t_ruler, t = time.perf_counter() - t, time.perf_counter()
    ppl = []
    for L in cfg["ppl"]:
        r = perplexity_batched(model, tokens, L, L // 2,
                               max_batch_tokens=max(cfg["batch_tokens"], L))
        ppl.append(f"{r.perplexity:.2f}")
        rows.append(dict(common, task="perplexity", length=L, value=r.perplexity,
                         n=r.scored_tokens))
    t_ppl = time.perf_counter() - t
    means = " ".join(f"{_k(L)}:{sum(s['score'] for s in ruler if s['length'] == L) / len(tasks):.2f}"
                     for L in cfg["ruler"])
    log(f"{row:<16} pairs {density:6.1%} | passkey {' '.join(passkey)} ({t_pk:.1f}s) | RULER "
        f"mean {means} ({t_ruler:.1f}s) | ppl {' '.join(ppl)} ({t_ppl:.1f}s)")


# ----------------------------------------------------------------------------- report
def write_csv(path: Path, fields: list, rows: list) -> None:
    """The rows' ``fields`` as a CSV file (other keys left out)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_report(rows: list, out: Path, cfg: dict, notes: list) -> None:
    write_csv(out / "retrieval.csv", ["method", "task", "length", "value", "n", "correct",
                                      "density", "pattern", "dense_kv_heads"], rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    val = {(r["method"], r["task"], r["length"]): r for r in rows}
    ref = "dense" if "dense" in methods else None

    def ratio(m, task, L):
        v, d = val.get((m, task, L)), val.get((ref, task, L))
        if v is None:
            return ""
        if d is None or m == ref or not d["value"]:
            return f"{v['value']:.3g}"
        return f"{v['value']:.3g} ({v['value'] / d['value']:.2f}x)"

    head = ["method", f"pairs @{_k(cfg['density_length'])}"]
    head += [f"passkey {_k(L)}" for L in cfg["passkey"]]
    head += [f"RULER mean {_k(L)}" for L in cfg["ruler"]]
    head += [f"ppl {_k(L)}" for L in cfg["ppl"]]
    body = []
    for m in methods:
        line = [m, f"{next(r['density'] for r in rows if r['method'] == m):.1%}"]
        for L in cfg["passkey"]:
            r = val.get((m, "passkey", L))
            line.append(f"{r['correct']}/{r['n']}" if r else "")
        for L in cfg["ruler"]:
            vs = [val[(m, t, L)]["value"] for t in TASKS if (m, t, L) in val]
            ds = [val[(ref, t, L)]["value"] for t in TASKS if (ref, t, L) in val]
            mean = sum(vs) / len(vs) if vs else float("nan")
            dmean = sum(ds) / len(ds) if ds else float("nan")
            line.append(f"{mean:.2f}" + (f" ({mean / dmean:.2f}x)" if ref and m != ref and dmean
                                         else ""))
        line += [ratio(m, "perplexity", L) for L in cfg["ppl"]]
        body.append(line)
    tasks_head = ["method"] + [f"{t} {_k(L)}" for L in cfg["ruler"] for t in TASKS]
    tasks_body = [[m] + [f"{val[(m, t, L)]['value']:.2f}" if (m, t, L) in val else ""
                         for L in cfg["ruler"] for t in TASKS] for m in methods]
    text = ["# Retrieval study", "", *notes, "", markdown_table(head, body), "",
            "## RULER-style tasks (fraction of items recalled)", "",
            markdown_table(tasks_head, tasks_body), ""]
    (out / "retrieval.md").write_text("\n".join(text))
    cols = [("passkey", L) for L in cfg["passkey"]] + [(t, L) for L in cfg["ruler"]
                                                        for t in TASKS]
    plot_heatmap([[val[(m, t, L)]["value"] if (m, t, L) in val else None for t, L in cols]
                  for m in methods], methods, [f"{t} {_k(L)}" for t, L in cols],
                 out / "retrieval_heatmap.png", "retrieval (fraction correct)")


# ----------------------------------------------------------------------------- main
def setup(args, parser, out: Path):
    """``--smoke``'s tiny assets (else ``--model`` and ``--corpus`` are required), the output
    folder, and ``(device, dtype)``: bf16 on CUDA, float32 on the CPU (also retrieval_finetune.py)."""
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.model, args.corpus = smoke_assets(out / "smoke_assets")
    elif not (args.model and args.corpus):
        parser.error("--model and --corpus are required (or --smoke)")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="retrieval_study.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (save_pretrained layout)")
    p.add_argument("--corpus", help="text directory (see the module docstring)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.3],
                   help="dense kv-head budgets of the calibrated rows (default 0.1 0.15 0.2 "
                        "0.3; on SmolLM2-135M 0.2 is 27 %% of the causal pairs at 64K)")
    p.add_argument("--methods", nargs="+", default=["needle_mass", "ablation"],
                   choices=["needle_mass", "ablation"], help="calibration methods")
    p.add_argument("--no-coverage", action="store_true", help="skip the coverage rows")
    p.add_argument("--ruler-trials", type=int, default=1, help="prompts per task, length and "
                   "depth (default 1: 5 per task and length)")
    p.add_argument("--ppl-tokens", type=int, default=65536, help="held-out tokens scored")
    p.add_argument("--rescore", type=int, default=2, help="ablation re-scoring (default 2)")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per forward")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--ruler-lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--ppl-lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--cal-depths", type=float, nargs="+", default=[0.2, 0.5, 0.8],
                   help="needle depths of the calibration prompts")
    p.add_argument("--cal-trials", type=int, default=1, help="calibration prompts per task, "
                   "length and depth")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random model and tiny lengths on the CPU (tests the script)")
    args = p.parse_args(argv)
    out = Path(args.out)
    device, dtype = setup(args, p, out)
    cfg = settings(args)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = Path(args.corpus)
    held = read_documents(corpus / "heldout" if (corpus / "heldout").is_dir() else corpus)
    hay = read_documents(corpus / "train") if (corpus / "train").is_dir() else held
    tok = AutoTokenizer.from_pretrained(str(args.model))
    tokens = tokenize_corpus(tok, held, cfg["ppl_tokens"])
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype,
                                                 attn_implementation="hilbert_dilated")
    model.to(device).eval()
    base = H.get_pattern(model.config).replace(dense_kv_heads=[])
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    notes = [f"model `{args.model}`, {dtype}, {dev_name}; held-out tokens {tokens.numel()}; "
             f"words: {word_list()[1]}; base pattern {base}",
             f"command: `python examples/benchmarks/retrieval_study.py "
             f"{' '.join(sys.argv[1:] if argv is None else argv)}`"]
    log(notes[0])
    log(plan(cfg, args, tokens.numel(), model.config.num_hidden_layers * hkv))
    rows: list = []
    timings = {}

    def part(name, fn):
        t = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - t
        write_report(rows, out, cfg, notes + ["times (s): " + ", ".join(
            f"{k} {v:.0f}" for k, v in timings.items())])

    def sparse(pattern, per_layer=None):
        H.configure(model, pattern, keep_dense_heads=False)
        if per_layer is not None:
            H.set_dense_kv_heads(model, per_layer)
        return dict(pattern=str(pattern), dense_kv_heads=json.dumps(per_layer or []))

    def dense_row():
        model.set_attn_implementation("sdpa")
        evaluate_row(model, tok, cfg, tokens, hay, "dense", rows, {"pattern": "dense (sdpa)"})

    part("dense", dense_row)
    part("default", lambda: evaluate_row(model, tok, cfg, tokens, hay, "default", rows,
                                         sparse(base)))
    top = max(args.budgets)
    for method in args.methods:
        def calibrated(method=method):
            sparse(base)
            res = calibrate(model, tok, budget=top, method=method, lengths=cfg["cal_lengths"],
                            tasks=("passkey", "niah_multikey"), depths=cfg["cal_depths"],
                            trials=cfg.get("cal_trials", 1), rescore=cfg["rescore"], max_batch_tokens=cfg["batch_tokens"],
                            density_length=cfg["density_length"], progress=False)
            (out / f"calibration_{method}.json").write_text(json.dumps(res.to_dict(), indent=1))
            log(f"calibration {method}: {res.forwards} forwards, {res.seconds:.1f} s\n"
                + res.summary())
            timings[f"calibrate {method}"] = res.seconds
            for b in sorted(args.budgets):
                meta = sparse(base, res.per_layer_for(b))
                evaluate_row(model, tok, cfg, tokens, hay, f"{method}@{b:g}", rows, meta)
        part(f"{method} rows", calibrated)
    if not args.no_coverage:
        for name, pat in coverage_patterns(base, hq, hkv).items():
            part(name, lambda name=name, pat=pat: evaluate_row(model, tok, cfg, tokens, hay,
                                                               name, rows, sparse(pat)))
    log("times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    log(f"wrote {out / 'retrieval.csv'}, {out / 'retrieval.md'}, {out / 'retrieval_heatmap.png'}")
    print((out / "retrieval.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
