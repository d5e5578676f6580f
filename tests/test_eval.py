"""Long-context eval (perplexity, passkey, report) and the model benchmark's smoke test, on CPU."""

import csv
import json
import math
import re

import pytest
import torch

from conftest import CSV_6G, model_tol, reorder_tol
from hf_hilbert_attn.tools.evaluation import (
    EvalConfig,
    evaluate_passkey,
    evaluate_perplexity,
    make_passkey_prompt,
    resolve_pattern,
    run_eval,
    score_passkey,
    strided_windows,
)
from hf_hilbert_attn.tools.evaluation.corpus import (
    build_char_tokenizer,
    build_default_model,
    load_corpus,
    tokenize_corpus,
)
from hf_hilbert_attn.tools.evaluation.perplexity import window_nll


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tok):
    return build_default_model(tok, seed=1)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    cfg = EvalConfig(patterns=("dense", "tiny"), lengths=(64, 128), ppl_tokens=400,
                     passkey_lengths=(128,), depths=(0.0, 1.0), trials=1, max_new_tokens=6,
                     out_dir=str(out), progress=False, device="cpu")  # also where there is CUDA
    return out, run_eval(cfg)


def _rows(out):
    with open(out / "results.csv") as f:
        return list(csv.DictReader(f))


def test_eval_writes_table_csv_and_pngs(eval_run):
    out, res = eval_run
    for name in ("results.csv", "results.md", "perplexity.png", "passkey_heatmap.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in ("perplexity.png", "passkey_heatmap.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert md == res["markdown"]
    assert "## Perplexity by context length" in md and "## Passkey retrieval" in md
    assert re.search(r"^\| sdpa \| [0-9.]+ \| [0-9.]+ \|$", md, re.M), md
    rows = _rows(out)
    methods = {r["method"] for r in rows}
    expected = {"sdpa", "hilbert_dilated:dense", "hilbert_dilated:tiny"}
    assert methods == expected
    ppl = [r for r in rows if r["task"] == "perplexity"]
    pk = [r for r in rows if r["task"] == "passkey"]
    assert len(ppl) == 2 * len(methods) and len(pk) == 2 * len(methods)
    for r in ppl:
        # every token but the first is scored exactly once, whatever the window length
        assert int(r["scored_tokens"]) == 399
        assert 1.0 < float(r["value"]) < 1e4 and float(r["tokens_per_s"]) > 0
        assert r["mem_kind"] == "cpu_rss_delta"
    for r in pk:
        assert 0.0 <= float(r["value"]) <= 1.0


def test_eval_sdpa_equals_hilbert_dense(eval_run):
    _, res = eval_run
    ppl = {(r["method"], r["length"]): r["value"] for r in res["rows"] if r["task"] == "perplexity"}
    # the same function through other sums: ~400 tokens' NLL, rows of <= 128 keys, 64 features;
    # exp turns the mean NLL's relative error into |log ppl| times it
    tol = model_tol(400, 128, 64) * max(1.0, math.log(max(ppl.values())))
    for L in (64, 128):
        assert ppl[("hilbert_dilated:dense", L)] == pytest.approx(ppl[("sdpa", L)], rel=tol)
    # "tiny" (dense within 64 tokens) is dense at L=64 but not at L=128: the pattern is applied.
    assert ppl[("hilbert_dilated:tiny", 64)] == pytest.approx(ppl[("sdpa", 64)], rel=tol)
    assert ppl[("hilbert_dilated:tiny", 128)] != pytest.approx(ppl[("sdpa", 128)], rel=tol)


# ----------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize("n,L,stride", [(97, 16, 8), (100, 10, 9), (5, 16, 8), (64, 8, 1)])
def test_strided_windows_score_every_token_once(n, L, stride):
    seen = []
    for begin, end, scored in strided_windows(n, L, stride):
        # a scored token's predecessor is always inside its window
        assert end - begin <= L and 1 <= scored <= end - begin - 1
        seen += list(range(end - scored, end))
    assert seen == list(range(1, n))


def test_strided_windows_bad_arguments():
    with pytest.raises(ValueError, match="stride must be in"):
        list(strided_windows(100, 16, 16))
    with pytest.raises(ValueError, match="context length must be >= 2"):
        list(strided_windows(100, 1, 1))
    with pytest.raises(ValueError, match="need at least 2 tokens"):
        list(strided_windows(1, 16, 8))


def test_window_nll_matches_transformers_loss(tiny_model):
    ids = torch.randint(0, 100, (1, 57))
    for scored in (1, 20, 56):
        labels = ids.clone()
        labels[0, :57 - scored] = -100
        with torch.no_grad():
            loss = tiny_model(input_ids=ids, labels=labels).loss
        assert window_nll(tiny_model, ids, scored) == pytest.approx(
            float(loss) * scored, rel=model_tol(scored, 57, 64))


def test_perplexity_equals_per_window_sum(tiny_model):
    tokens = torch.randint(0, 100, (150,))
    res = evaluate_perplexity(tiny_model, tokens, 40, 15)
    manual, count = 0.0, 0
    for b, e, s in strided_windows(150, 40, 15):
        ids = tokens[b:e].unsqueeze(0)
        with torch.no_grad():
            logp = torch.log_softmax(tiny_model(input_ids=ids).logits[0].float(), -1)
        for t in range(e - b - s, e - b):
            manual -= float(logp[t - 1, ids[0, t]])
            count += 1
    assert res.scored_tokens == count == 149
    # exp of a 149-token mean: the mean's relative error times |log ppl| (float64 sum here)
    rel = model_tol(149, 40, 64) * max(1.0, manual / count)
    assert res.perplexity == pytest.approx(math.exp(manual / count), rel=rel)


# ----------------------------------------------------------------------------- passkey
def test_score_passkey_known_answers():
    assert score_passkey(" 48213. Remember", "48213")
    assert score_passkey("48213", "48213")
    assert not score_passkey(" 48214.", "48213")
    assert not score_passkey(" 482130", "48213")  # a longer number is not the key
    assert not score_passkey(" the key", "48213")
    assert not score_passkey("", "48213")
    assert not score_passkey(" 1 then 48213", "48213")  # only the first number counts


def _needle_reader(tok):
    """A fake model that reads the needle from its prompt: it must score 100%."""
    def generate(ids):
        text = tok.decode(ids[0])
        return " " + re.search(r"The pass key is (\d+)\.", text).group(1) + ". Remember"
    return generate


@pytest.mark.parametrize("length", [122, 200, 333])
def test_passkey_prompt_length_and_needle_depth(tok, length):
    for depth in (0.0, 0.3, 1.0):
        p = make_passkey_prompt(tok, length, depth, "70707")
        assert p.input_ids.shape == (1, length)
        text = tok.decode(p.input_ids[0])
        at = text.index("The pass key is 70707.")
        assert p.needle_start == at  # one token per character
        assert text.endswith("The pass key is")
        if depth == 0.0:
            assert text[:at].endswith("\n")  # right after the intro
        if depth == 1.0:
            assert text[at:].startswith("The pass key is 70707. Remember it. \n")


def test_passkey_solvable_by_a_reader_and_not_by_guessing(tok):
    depths = [0.0, 0.25, 0.5, 0.75, 1.0]
    rows = evaluate_passkey(_needle_reader(tok), tok, 160, depths, trials=3, seed=5)
    assert [r["accuracy"] for r in rows] == [1.0] * 5
    keys = {a for r in rows for a in r["answers"]}
    assert len(keys) > 1  # keys differ between trials
    wrong = evaluate_passkey(lambda ids: " 00000.", tok, 160, depths, trials=3)
    assert [r["accuracy"] for r in wrong] == [0.0] * 5

    # A reader that only sees the first half of its prompt finds shallow needles only.
    def half_reader(ids):
        text = tok.decode(ids[0, : ids.shape[1] // 2])
        m = re.search(r"The pass key is (\d+)\.", text)
        return f" {m.group(1)}" if m else " 12"
    half = evaluate_passkey(half_reader, tok, 300, depths, trials=2)
    assert [r["accuracy"] for r in half] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_passkey_real_model_runs_generate(tok, tiny_model):
    from hf_hilbert_attn.tools.evaluation.passkey import hf_generate_fn

    gen = hf_generate_fn(tiny_model, tok, max_new_tokens=5)
    p = make_passkey_prompt(tok, 128, 0.5, "12345")
    text = gen(p.input_ids)
    assert isinstance(text, str) and 0 < len(text) <= 5 * 8


def test_passkey_bad_arguments(tok):
    with pytest.raises(ValueError, match="too short"):
        make_passkey_prompt(tok, 121, 0.5, "12345")
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got 1.5"):
        make_passkey_prompt(tok, 200, 1.5, "12345")


# ----------------------------------------------------------------------------- corpus, patterns
def test_load_corpus_text_jsonl_parquet(tmp_path, tok):
    docs = ["first document here", "second one", "third"]
    # A text file is one document, newlines kept; json/parquet rows are documents.
    texts = ["ACT I.\n\nHam. Who's there?\n", "line one\nline two"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs))
    datasets = pytest.importorskip("datasets")  # optional (the tools extra)

    datasets.Dataset.from_dict({"text": docs}).to_parquet(str(tmp_path / "a.parquet"))
    assert load_corpus([str(tmp_path / "0.txt"), str(tmp_path / "1.txt")]) == texts
    assert load_corpus([str(tmp_path / "a.jsonl")], text_field="body") == docs
    assert load_corpus([str(tmp_path / "a.parquet")]) == docs
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus([str(tmp_path / "a.jsonl")])
    with pytest.raises(ValueError, match="all be of one kind"):
        load_corpus([str(tmp_path / "0.txt"), str(tmp_path / "a.jsonl")])
    with pytest.raises(FileNotFoundError, match="corpus file or directory not found"):
        load_corpus([str(tmp_path / "missing.txt")])
    ids = tokenize_corpus(tok, docs, 1000)
    assert ids.numel() == sum(len(d) + 1 for d in docs)  # chars + one EOS per document
    assert tok.decode(ids[: len(docs[0])]) == docs[0]


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty.parquet"])
def test_load_corpus_empty_file_is_one_line_error(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=f"corpus file is empty: .*{name}$"):
        load_corpus([str(tmp_path / name)])
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="blank.txt holds only whitespace"):
        load_corpus([str(tmp_path / "blank.txt")])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8 text"):
        load_corpus([str(tmp_path / "latin1.txt")])


def test_builtin_corpus_is_deterministic():
    a, b = load_corpus(None, num_chars=5000), load_corpus(None, num_chars=5000)
    assert a == b and sum(map(len, a)) >= 5000


def test_resolve_pattern_forms(tmp_path):
    assert resolve_pattern("64,256:1,4")[1].segment_lengths == (64, 256)
    assert resolve_pattern("tiny")[1].dilation_rates == (1, 4)
    assert resolve_pattern("longnet_lm")[1].segment_lengths[-1] == 32768
    with pytest.raises(ValueError, match="dilation_rates\\[1\\] must be <= segment_lengths\\[1\\]"):
        resolve_pattern("8,16:1,32")
    with pytest.raises(ValueError, match="unknown pattern 'nope'"):
        resolve_pattern("nope")
    with pytest.raises(FileNotFoundError, match="pattern file not found"):
        resolve_pattern(str(tmp_path / "missing.yaml"))


# ----------------------------------------------------------------------------- bench_model
def test_chunked_loss_matches_full_loss():
    from hf_hilbert_attn.training import chunked_lm_loss

    h = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (2, 37))
    y[0, :5] = -100
    loss = chunked_lm_loss(h, w, y, chunk=8)
    ref = torch.nn.functional.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(),
                                            ignore_index=-100)
    # float64, chunks of 8 vs the whole: the 69-token mean, 50-way softmax, 16-term dots
    tol = 2 * reorder_tol(69 + 50 + 16, torch.float64)
    assert loss.item() == pytest.approx(ref.item(), rel=tol)
    g = torch.autograd.grad(loss, (h, w))
    g_ref = torch.autograd.grad(ref, (h, w))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, float(b.abs().max())))


def test_bench_model_tiny_smoke(tmp_path, capsys):
    from hf_hilbert_attn.tools.evaluation.bench_model import main

    rc = main(["--preset", "tiny", "--lengths", "64", "96", "--iters", "1", "--warmup", "0",
               "--max-len", "--max-len-start", "64", "--max-len-step", "32", "--max-len-cap",
               "128", "--device", "cpu", "--out-dir", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| method | tokens | status | tokens/s" in out and "## Longest sequence" in out
    # CPU timings: no ratios printed as if they measured
    table = [ln for ln in out.splitlines() if ln.startswith("| hilbert_dilated:tiny | 64 |")]
    assert table and table[0].endswith("| n/a | n/a |"), table
    assert "CPU timings: step times of this size swing" in out
    assert (tmp_path / "bench_model_tiny_cpu.csv").is_file()
    assert (tmp_path / "bench_model_tiny_maxlen_cpu.csv").is_file()
    assert (tmp_path / "bench_model_tiny_cpu.png").read_bytes()[:4] == b"\x89PNG"
    with open(tmp_path / "bench_model_tiny_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["status"] for r in rows} == {"ok"}
    assert len(rows) == 2 * 2
    for r in rows:
        assert float(r["tokens_per_s"]) > 0 and math.isfinite(float(r["loss"]))
    with open(tmp_path / "bench_model_tiny_maxlen_cpu.csv") as f:
        mx = list(csv.DictReader(f))
    assert all(int(r["max_len"]) == 128 and r["limited_by"] == "cap" for r in mx)


def test_bench_model_compiled_layers_same_loss(tmp_path):
    # --compile: every decoder layer compiled (both implementations alike); same model, same
    # data -> the same loss as eager, and the rows say they were compiled
    from hf_hilbert_attn.tools.evaluation.bench_model import PRESETS, build_model, main
    from hf_hilbert_attn.tools.evaluation import resolve_pattern

    _, pat = resolve_pattern("tiny")
    kw = PRESETS["tiny"]["model"]
    eager = build_model(kw, "hilbert_dilated", torch.float32, torch.device("cpu"), pat)
    comp = build_model(kw, "hilbert_dilated", torch.float32, torch.device("cpu"), pat,
                       compile=True)
    ids = torch.randint(0, kw["vocab_size"], (1, 70))
    with torch.no_grad():
        a = eager(input_ids=ids, labels=ids).loss
        b = comp(input_ids=ids, labels=ids).loss
    # compiled vs eager: fused kernels add the same sums in another order
    assert b.item() == pytest.approx(a.item(), rel=model_tol(70, 70, 64))
    rc = main(["--preset", "tiny", "--impls", "hilbert_dilated", "--lengths", "64", "--iters",
               "1", "--warmup", "1", "--compile", "--device", "cpu", "--no-plots", "--out-dir",
               str(tmp_path), "--no-progress"])
    assert rc == 0
    with open(tmp_path / "bench_model_tiny_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["compiled"] for r in rows] == ["True"] and float(rows[0]["tokens_per_s"]) > 0


# ----------------------------------------------------------------------------- sequence parallel
def test_sequence_parallel_size_that_does_not_divide_the_processes_is_one_line(tmp_path):
    # every rank of `torchrun --nproc_per_node 2 ... --sp-size 3` said so in a traceback
    import torch.distributed as dist

    from hf_hilbert_attn.tools.evaluation import runner
    from hf_hilbert_attn.tools.evaluation._args import InputError

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(InputError, match=r"^--sp-size 3 must divide the number of "
                                             r"processes \(1\)$"):
            runner._topology(EvalConfig(sp_size=3), torch.device("cpu"), [])
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_sequence_parallel_perplexity_equals_single_process(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("hf_hilbert_attn.sharding")
    repo = Path(__file__).resolve().parents[1]
    args = ["--tasks", "perplexity", "--lengths", "128", "--ppl-tokens", "300", "--pattern",
            "tiny", "--no-sdpa", "--device", "cpu", "--no-plots", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(repo / "examples" / "eval_long_context.py"), "--sp-size", "2",
         "--out-dir", str(tmp_path / "sp")] + args,
        capture_output=True, text=True, env=env, cwd=repo, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded over 2 ranks" in proc.stdout
    sp = _rows(tmp_path / "sp")
    single = run_eval(EvalConfig(patterns=("tiny",), include_sdpa=False, tasks=("perplexity",),
                                 lengths=(128,), ppl_tokens=300, out_dir=str(tmp_path / "one"),
                                 plots=False, progress=False, device="cpu"))["rows"]
    assert len(sp) == len(single) == 1
    assert int(sp[0]["scored_tokens"]) == single[0]["scored_tokens"] == 299
    # the ring and the shards' NLL sums in another order, and the CSV's 6 digits
    rel = model_tol(300, 128, 64) * max(1.0, math.log(single[0]["value"])) + CSV_6G
    assert float(sp[0]["value"]) == pytest.approx(single[0]["value"], rel=rel)


# ----------------------------------------------------------------------------- resume, small corpus
def _cfg(out, **kw):
    base = dict(patterns=("tiny",), tasks=("perplexity",), lengths=(64, 128), ppl_tokens=300,
                out_dir=str(out), plots=False, progress=False)
    base.update(kw)
    return EvalConfig(**base)


def test_eval_writes_each_cell_and_resumes(tmp_path, monkeypatch):
    from hf_hilbert_attn.tools.evaluation import runner

    whole = run_eval(_cfg(tmp_path / "whole"))["rows"]
    calls = []
    real = runner.evaluate_perplexity

    def stop_after_two(*a, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is stopped during its third cell
        calls.append(a[2])
        return real(*a, **kw)

    monkeypatch.setattr(runner, "evaluate_perplexity", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_eval(_cfg(tmp_path / "part"))
    kept = _rows(tmp_path / "part")  # the two finished cells are on disk
    assert [(r["method"], int(r["length"])) for r in kept] == [("sdpa", 64), ("sdpa", 128)]

    calls.clear()
    monkeypatch.setattr(runner, "evaluate_perplexity",
                        lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    res = run_eval(_cfg(tmp_path / "part"))
    assert calls == [64, 128]  # only hilbert_dilated:tiny's cells ran
    assert [(r["method"], r["length"]) for r in res["rows"]] == \
        [(r["method"], r["length"]) for r in whole]
    for a, b in zip(res["rows"], whole):
        assert a["value"] == pytest.approx(b["value"], rel=2 * CSV_6G)  # resumed from the CSV
    assert any("resumed: 2 cell(s)" in n for n in res["notes"])
    assert len(_rows(tmp_path / "part")) == 4
    calls.clear()
    run_eval(_cfg(tmp_path / "part", lengths=(64, 128, 256)))
    assert calls == [256, 256]  # a longer length: only its cells
    with pytest.raises(ValueError, match=r"holds results of other settings \(ppl_tokens: 300 -> "
                                         r"600\): use --fresh"):
        run_eval(_cfg(tmp_path / "part", ppl_tokens=600))
    calls.clear()
    run_eval(_cfg(tmp_path / "part", fresh=True))
    assert calls == [64, 128, 64, 128]  # --fresh: every cell again


def test_eval_refuses_a_corpus_shorter_than_the_longest_length(tmp_path):
    (tmp_path / "c.txt").write_text("abc")
    with pytest.raises(ValueError, match="the corpus has 4 tokens, fewer than the longest "
                                         "context length 64"):
        run_eval(_cfg(tmp_path / "o", corpus=(str(tmp_path / "c.txt"),), lengths=(64,)))
    assert not (tmp_path / "o" / "results.csv").exists()
    with pytest.raises(ValueError, match=r"ppl_tokens \(100\) must be >= the longest context "
                                         r"length \(128\)"):
        run_eval(_cfg(tmp_path / "o", ppl_tokens=100))


def test_txt_corpus_is_one_document_per_file(tmp_path, tok):
    # newlines kept, no EOS between the lines of a file: one EOS per file
    (tmp_path / "a.txt").write_text("line one\nline two\n")
    (tmp_path / "b.txt").write_text("third\n")
    docs = load_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    ids = tokenize_corpus(tok, docs, 1000)
    assert (ids == tok.eos_token_id).sum() == 2
    assert tok.decode(ids[:18]) == "line one\nline two\n"


def test_bad_yaml_pattern_is_an_input_error(tmp_path):
    from hf_hilbert_attn.tools.evaluation._args import InputError

    (tmp_path / "bad.yaml").write_text("segment_lengths: [1, 2\n")
    with pytest.raises(InputError, match="is not valid YAML: .* at line 2"):
        resolve_pattern(str(tmp_path / "bad.yaml"))


# ----------------------------------------------------------------------------- issue 37: ruler
def test_builtin_ruler_defaults_build_every_prompt(tok):
    # `eval --tasks ruler` on the built-in model (no MODEL, no --lengths): its default prompt
    # lengths hold every RULER task (128 did not: "206 tokens" after the model was built)
    from hf_hilbert_attn.tools.evaluation.runner import BUILTIN_RULER_LENGTHS, check_prompts

    cfg = EvalConfig(tasks=("ruler",)).resolved()
    assert cfg.passkey_lengths == BUILTIN_RULER_LENGTHS == (512,)
    check_prompts(cfg, tok)  # raises if a prompt cannot be built
    both = EvalConfig(tasks=("perplexity", "passkey", "ruler")).resolved()
    assert both.lengths == (128, 256, 512) and both.passkey_lengths == (512,)
    # given lengths are the user's: not replaced
    assert EvalConfig(tasks=("ruler",), lengths=(256,)).resolved().passkey_lengths == (256,)
    assert EvalConfig(tasks=("passkey",)).resolved().passkey_lengths == (128, 256, 512)


def test_ruler_lengths_checked_before_any_model(tok, capsys, monkeypatch, tmp_path):
    # one line, exit 2, no model built; the length it names builds every prompt of the run
    from hf_hilbert_attn.tools.cli import main
    from hf_hilbert_attn.tools.evaluation import runner
    from hf_hilbert_attn.tools.evaluation.ruler import RulerGenerator, TASKS, ruler_samples

    def no_model(*a, **k):
        raise AssertionError("a model was built before the lengths were checked")

    monkeypatch.setattr(runner, "load_model", no_model)
    for argv, start in ((["--lengths", "128", "256"], "--lengths 128 is too short for every "
                                                      "RULER task with this tokenizer"),
                        (["--passkey-lengths", "360", "1024"],
                         "--passkey-lengths 360 is too short for the RULER task(s) ")):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--tasks", "ruler", *argv, "--out-dir", str(tmp_path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err
        assert last.startswith(f"hf-hilbert-attn eval: error: --tasks ruler: {start}"), last
        need, example = map(int, re.search(
            r"the prompts need at least (\d+) tokens \(e\.g\. (\d+)\)$", last).groups())
        assert 360 < need <= example < 2 * need
        ruler_samples(RulerGenerator(tok, seed=0), TASKS, [need], (0.0, 0.5, 1.0), 2)


def test_ruler_check_names_only_the_tasks_that_do_not_fit(tok):
    from hf_hilbert_attn.tools.evaluation.ruler import check_lengths

    check_lengths(tok, [400, 512], tasks=["niah_single", "common_words"])  # fits
    with pytest.raises(ValueError) as e:
        check_lengths(tok, [300], tasks=["niah_single", "variable_tracking"], what="L")
    msg = str(e.value)
    assert msg.startswith("L 300 is too short for the RULER task(s) variable_tracking with")
    with pytest.raises(ValueError, match="L 128 is too short for every RULER task"):
        check_lengths(tok, [128, 4096], tasks=["niah_single"], what="L")


# ----------------------------------------------------------------------------- issue 37: progress
def test_eval_prints_progress_lines_when_stderr_is_a_log(tmp_path, capsys, monkeypatch):
    # capsys: stderr is not a terminal. A line per method and per cell (start, done), and with
    # HF_HILBERT_PROGRESS_SECONDS=0 one per step; --no-progress: none
    from hf_hilbert_attn.tools.cli import main

    monkeypatch.setenv("HF_HILBERT_PROGRESS_SECONDS", "0")
    argv = ["eval", "--pattern", "tiny", "--lengths", "64", "--ppl-tokens", "200",
            "--passkey-lengths", "128", "--depths", "0.5", "--trials", "1", "--max-new-tokens",
            "2", "--out-dir", str(tmp_path), "--no-plots", "--fresh"]
    assert main(argv) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("eval")]
    assert err[0] == "eval: method 1/2 sdpa: loading the built-in model"
    assert err[1] == "eval [1/4] sdpa perplexity L=64: started, 0/6 windows"
    assert "eval [1/4] sdpa perplexity L=64: 3/6 windows, " in "\n".join(err)
    assert re.search(r"eval \[1/4\] sdpa perplexity L=64: 3/6 windows, \d+s elapsed, ~\d+s left",
                     "\n".join(err))
    assert any(ln.startswith("eval [1/4] sdpa perplexity L=64: done, 6/6 windows in ")
               for ln in err)
    assert "eval: method 2/2 hilbert_dilated:tiny: loading the built-in model" in err
    assert any(ln.startswith("eval [4/4] hilbert_dilated:tiny passkey L=128: done, 1/1 prompts")
               for ln in err)
    assert main(argv + ["--no-progress"]) == 0
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("eval")]
