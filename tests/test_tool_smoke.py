"""Every benchmark and eval command on the CPU, with a pattern that has dense key/value heads,
sink tokens and sliding windows (issue 37, item 3: tools that crashed on the features we ship).

One test id per command: the ``hf-hilbert-attn`` subcommands (``show-pattern``, ``eval``,
``bench model|attention|cpu|generate``, ``quality``) and the scripts under
``examples/benchmarks/``, each on tiny shapes (the PyTorch path; ``host_overhead.py --stub``
stands in for the kernels). Each asserts what the command wrote: exit status 0, the rows it
should have, finite numbers, and where the command counts pairs, the count of
``count_pairs(..., num_kv_heads=Hkv)`` (a pattern with dense heads needs the key/value heads
to count them: ``kernel_timing.py`` and ``bench attention`` raised "pass num_kv_heads").

Not here: ``bench_attention.py`` and ``bench_model.py`` (the same ``main`` as ``bench
attention`` / ``bench model``); ``retrieval_study.py --smoke`` and ``retrieval_finetune.py
--smoke`` (they calibrate dense heads onto a sliding pattern with sinks themselves:
tests/test_calibrate.py, tests/test_retrieval_finetune.py); ``compiled_step.py`` (compiles a
135M model's layers on a GPU); ``ring_trace_summary.py`` (reads traces, no pattern).
"""

import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import CSV_6G, attention_tol, eps, model_tol
from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn.tools.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "examples" / "benchmarks"
SHIPPED = REPO / "configs" / "patterns" / "default_kv0_dense.yaml"  # the pattern
# Dense key/value head 0, 2 sink tokens, sliding windows: at the tests' 64-256 tokens every
# part of it is in play (the shipped one allows every pair below 2048 tokens but its dense heads).
PATTERN_YAML = """\
segment_lengths: [32, 64, 128]
dilation_rates: [1, 2, 4]
query_dilation: per_head
sink_tokens: 2
window: sliding
dense_kv_heads: [0]
"""
# The same features on fixed segments: what the gather baseline of `bench attention` takes.
SEGMENT_YAML = """\
segment_lengths: [32, 64]
dilation_rates: [1, 2]
sink_tokens: 1
dense_kv_heads: [1]
"""
HQ, HKV, D = 4, 2, 16  # the attention benchmarks' shape: Hq / Hkv / head_dim
BF16_TOL = 3 * eps("bfloat16")  # bf16 inputs and output against float32 (test_benchmarks.py)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny shapes run on one intra-op thread: on a busy machine two threads wait for each other
    in OpenMP barriers (a 128-token forward+backward took 1.4 s instead of 15 ms at a load of 9
    on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def patterns(tmp_path_factory):
    root = tmp_path_factory.mktemp("patterns")
    (root / "hybrid.yaml").write_text(PATTERN_YAML)
    (root / "hybrid_seg.yaml").write_text(SEGMENT_YAML)
    return root / "hybrid.yaml", root / "hybrid_seg.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A saved tiny random Llama (4 query / 2 key-value heads, character tokenizer) and a
    generated corpus split into train/ and heldout/."""
    from hf_hilbert_attn.tools.evaluation.corpus import (build_char_tokenizer,
                                                         build_default_model, builtin_corpus)

    root = tmp_path_factory.mktemp("assets")
    tok = build_char_tokenizer()
    model = build_default_model(tok, seed=2)
    assert model.config.num_key_value_heads > 0
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    docs = builtin_corpus(12_000, seed=4)
    for split, part in (("train", docs[:2]), ("heldout", docs[2:4])):
        (root / "corpus" / split).mkdir(parents=True)
        for i, d in enumerate(part):
            (root / "corpus" / split / f"{i:02d}.txt").write_text(d)
    return root / "model", root / "corpus"


def _script(name):
    """An example script as a module (its ``main(argv)`` runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"smoke_{name}", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _finite(row, *cols, positive=True):
    for c in cols:
        v = float(row[c])
        assert math.isfinite(v) and (v > 0 or not positive), (c, row)


def _dense_pairs(s):
    return s * (s + 1) // 2


# ----------------------------------------------------------------------------- the CLI
def cli_show_pattern(capsys, patterns, **_):
    p = DilatedPattern.from_yaml(patterns[0])
    assert cli(["show-pattern", str(patterns[0]), "--length", "64", "--heads", "4"]) == 0
    out = capsys.readouterr().out
    pairs = p.count_pairs(64, 4, num_kv_heads=4)  # show-pattern counts one kv head per head
    assert pairs[0] == _dense_pairs(64) > pairs[1]  # head 0 is the dense one
    assert f"allowed pairs per head   {', '.join(map(str, pairs))}" in out
    assert f"density                  {sum(pairs) / (4 * _dense_pairs(64)):.4%}" in out
    assert "sliding, sinks=2, dense kv heads [0]" in out


def cli_eval(capsys, patterns, tmp_path, **_):
    out = tmp_path / "eval"
    assert cli(["eval", "--pattern", str(patterns[0]), "--no-sdpa", "--lengths", "64",
                "--ppl-tokens", "128", "--passkey-lengths", "128", "--depths", "0.5",
                "--trials", "1", "--max-new-tokens", "4", "--out-dir", str(out),
                "--no-progress", "--no-plots"]) == 0
    rows = _csv(out / "results.csv")
    assert {(r["method"], r["task"]) for r in rows} == {
        ("hilbert_dilated:hybrid", "perplexity"), ("hilbert_dilated:hybrid", "passkey")}
    for r in rows:
        _finite(r, "tokens_per_s", "seconds")
    (ppl,) = [r for r in rows if r["task"] == "perplexity"]
    _finite(ppl, "value")
    assert float(ppl["value"]) > 1 and int(ppl["scored_tokens"]) > 0
    assert "| hilbert_dilated:hybrid |" in capsys.readouterr().out


def cli_bench_model(capsys, patterns, tmp_path, **_):
    assert cli(["bench", "model", "--preset", "tiny", "--impls", "hilbert_dilated",
                "--pattern", str(patterns[0]), "--lengths", "64", "--iters", "1", "--warmup",
                "0", "--device", "cpu", "--out-dir", str(tmp_path), "--no-plots",
                "--no-progress"]) == 0
    (row,) = _csv(tmp_path / "bench_model_tiny_cpu.csv")
    assert row["method"] == "hilbert_dilated:hybrid" and row["status"] == "ok", row
    _finite(row, "step_s", "tokens_per_s", "loss")
    assert "| hilbert_dilated:hybrid | 64 | ok |" in capsys.readouterr().out


def cli_bench_attention(capsys, patterns, tmp_path, **_):
    from hf_hilbert_attn.tools.benchmarks.baselines import gather_pairs

    S = 128
    assert cli(["bench", "attention", "--device", "cpu", "--ours-backend", "torch",
                "--seq-lens", str(S), "--heads", str(HQ), "--kv-heads", str(HKV),
                "--head-dim", str(D), "--quick", "--check-queries", "16", "--quiet",
                "--patterns", ",".join(map(str, patterns)), "--impls", "ours-natural,gather-sdpa",
                "--out-dir", str(tmp_path)]) == 0
    rows = {(r["pattern"], r["impl_key"]): r for r in _csv(tmp_path / "bench_attention_cpu.csv")}
    assert len(rows) == 4
    for path in patterns:
        p, name = DilatedPattern.from_yaml(path), path.stem
        pairs = p.count_pairs_total(S, HQ, num_kv_heads=HKV)
        ours = rows[(name, "ours-natural")]
        assert ours["status"] == "ok", ours
        assert int(ours["pattern_pairs"]) == pairs and int(ours["own_pairs"]) == pairs
        assert float(ours["density"]) == pytest.approx(pairs / (HQ * _dense_pairs(S)),
                                                       rel=CSV_6G)
        _finite(ours, "fwd_ms", "bwd_ms", "fwd_bwd_ms", "tflops_fwd_bwd")
        assert float(ours["err_vs_pattern"]) < BF16_TOL, ours
    # sliding windows: no segments to gather
    gather = rows[(patterns[0].stem, "gather-sdpa")]
    assert gather["status"] == "unavailable" and "sliding" in gather["note"], gather
    # fixed segments: the configs alone (no sinks, no dense heads), overlaps counted per config
    gather = rows[(patterns[1].stem, "gather-sdpa")]
    seg = DilatedPattern.from_yaml(patterns[1])
    assert gather["status"] == "ok" and "configs only" in gather["note"], gather
    assert int(gather["own_pairs"]) == gather_pairs(seg, S, HQ) > 0
    assert float(gather["err_vs_own"]) < BF16_TOL, gather
    assert "wrote" in capsys.readouterr().out
    # the flex row (CUDA only in the benchmark): its block mask with the dense heads, eager
    _flex_matches_reference(DilatedPattern.from_yaml(patterns[0]))


def _flex_matches_reference(pattern, S=96):
    from hf_hilbert_attn import reference_attention
    from hf_hilbert_attn.tools.benchmarks.baselines import FlexDilated

    q = torch.randn(1, HQ, S, D)
    k, v = (torch.randn(1, HKV, S, D) for _ in range(2))
    fx = FlexDilated(pattern, S, HQ, "cpu", compile=False, num_kv_heads=HKV)
    want = reference_attention(q, k, v, pattern)
    # float32 both: the same sums in another order (S keys, D-term dots)
    tol = attention_tol(S, D) * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(fx(q, k, v), want, rtol=0, atol=tol)


def cli_bench_cpu(capsys, patterns, tmp_path, **_):
    assert cli(["bench", "cpu", "--lengths", "128", "--shapes", f"{HQ}/{HKV}x{D}", "--patterns",
                str(patterns[0]), "--repeats", "1", "--backward", "--out", str(tmp_path)]) == 0
    (row,) = _csv(next(tmp_path.glob("cpu_*threads.csv")))
    assert row["pattern"] == "hybrid" and row["length"] == "128", row
    _finite(row, "sdpa_fwd_ms", "ours_fwd_ms", "fwd_ratio", "ours_fwdbwd_ms", "fwdbwd_ratio")
    assert "hybrid" in capsys.readouterr().out


def cli_bench_generate(capsys, patterns, tmp_path, **_):
    assert cli(["bench", "generate", "--preset", "tiny", "--pattern", str(patterns[0]),
                "--contexts", "96", "--new-tokens", "2", "--prefill-chunk", "40",
                "--no-warmup", "--device", "cpu", "--quiet", "--out-dir", str(tmp_path)]) == 0
    rows = _csv(tmp_path / "bench_generate_tiny_cpu.csv")
    assert sorted(r["cache"] for r in rows) == ["dynamic", "pattern"]
    for r in rows:
        assert r["status"] == "ok" and r["pattern"] == "hybrid", r
        _finite(r, "prefill_tokens_per_s", "decode_tokens_per_s", "cache_gib")
        # a dense head reads every key: the pattern cache keeps them all
        assert int(r["stored_tokens"]) >= 96, r
    assert "dense kv heads [0]" in capsys.readouterr().out


def cli_quality(capsys, patterns, assets, tmp_path, **_):
    model, corpus = assets
    methods = tmp_path / "methods.yaml"
    methods.write_text(f"methods:\n  - label: hybrid\n    pattern: {patterns[0]}\n")
    out = tmp_path / "q"
    rc = cli(["quality", "--model", str(model), "--corpus", str(corpus), "--methods",
              str(methods), "--out", str(out), "--lengths", "64", "--ppl-tokens", "200",
              "--passkey-lengths", "128", "--depths", "0.5", "--trials", "1", "--batch-tokens",
              "4096", "--dtype", "float32", "--device", "cpu", "--no-plots", "--no-progress"])
    capsys.readouterr()
    errors = out / "errors.log"
    assert rc == 0, errors.read_text()[-2000:] if errors.is_file() else rc
    rows = _csv(out / "quality.csv")
    assert {r["task"] for r in rows} == {"perplexity", "passkey"}
    for r in rows:
        # the pattern's density counts the dense heads (2 key/value heads in this model)
        assert 0 < float(r["density"]) < 1, r
        _finite(r, "seconds")


# ----------------------------------------------------------------------------- examples/benchmarks
def kernel_timing(patterns, tmp_path, **_):
    out = tmp_path / "timing.csv"
    S = 128
    rows = _script("kernel_timing").main(
        ["--device", "cpu", "--no-check", "--seq", str(S), "--hq", str(HQ), "--hkv", str(HKV),
         "--dim", str(D), "--pattern", str(SHIPPED), str(patterns[0]), "--rep-ms", "1",
         "--csv", str(out)])
    got = {r["pattern"]: r for r in _csv(out)}
    assert len(rows) == 3 and set(got) == {SHIPPED.stem, "hybrid", "dense"}
    for path in (SHIPPED, patterns[0]):
        p, r = DilatedPattern.from_yaml(path), got[path.stem]
        want = p.count_pairs_total(S, HQ, num_kv_heads=HKV) / (HQ * _dense_pairs(S))
        assert float(r["density"]) == pytest.approx(want, rel=1e-9), r
        _finite(r, "fwd_ms", "fb_ms", "fwd_tflops", "fb_tflops")
    assert float(got["hybrid"]["density"]) < 1
    _finite(got["dense"], "fb_ms", "fb_tflops")
    # its per-launch pairs (--profile, GPU): the sparse part over the heads of the sparse key/
    # value heads; with the dense heads' pairs, every pair of the pattern
    p = DilatedPattern.from_yaml(patterns[0])
    per_launch = _script("kernel_timing").launch_pairs(p, S, HQ, HKV)
    dense_heads = int(p.dense_query_heads(HQ, HKV).sum())
    assert all(n > 0 for _, n in per_launch)
    assert (sum(n for _, n in per_launch) + dense_heads * _dense_pairs(S)
            == p.count_pairs_total(S, HQ, num_kv_heads=HKV))


def dense_heads(patterns, tmp_path, **_):
    out = tmp_path / "dense_heads.csv"
    _script("dense_heads").main(["--device", "cpu", "--seq", "128", "--hq", str(HQ), "--hkv",
                                 str(HKV), "--dim", str(D), "--pattern", str(patterns[0]),
                                 "--rep-ms", "1", "--csv", str(out)])
    (row,) = _csv(out)
    assert row["dense"] == "0", row  # the pattern's own dense heads
    _finite(row, "sparse_ms", "hybrid_ms", "sdpa_slice_ms", "sdpa_ms", "hybrid_over_sdpa")


def host_overhead(capsys, patterns, monkeypatch, **_):
    # --stub clears TRITON_INTERPRET (restored after the test) and sets one thread (_one_thread)
    if "TRITON_INTERPRET" in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _script("host_overhead").main(
        ["--stub", "--no-bind", "--seq", "128", "--hq", str(HQ), "--hkv", str(HKV), "--dim",
         str(D), "--pattern", str(patterns[0]), "--calls", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    for phase in ("forward", "backward"):
        m = re.search(rf"^\| {phase} \| (\d+) \| - \| - \| (\d+) \(", out, re.M)
        assert m, out
        # the sparse part's launches (3 configs) and the dense heads' slice, stubbed
        assert int(m.group(1)) > 0 and int(m.group(2)) >= 2, m.group(0)


def decode_cpu(patterns, tmp_path, **_):
    assert _script("decode_cpu").main(
        ["--contexts", "96", "--steps", "1", "--warmup", "0", "--layers", "1",
         "--prefill-chunk", "64", "--pattern", str(patterns[0]), "--out-dir", str(tmp_path)]) == 0
    rows = _csv(tmp_path / "decode_cpu.csv")
    assert [(r["attn"], r["cache"]) for r in rows] == [
        ("sdpa", "dynamic"), ("hilbert_dilated", "dynamic"), ("hilbert_dilated", "pattern")]
    for r in rows:
        _finite(r, "ms_per_token", "min_ms", "ratio_to_sdpa")
    assert {r["pattern"] for r in rows[1:]} == {"hybrid"}


def ring_volume(patterns, tmp_path, **_):
    out = tmp_path / "ring_volume.csv"
    _script("ring_volume").main(["--pattern", str(patterns[0]), "--seq-lens", "256", "--worlds",
                                 "2", "--hq", str(HQ), "--hkv", str(HKV), "--head-dim", str(D),
                                 "--csv", str(out)])
    rows = _csv(out)
    assert sorted(r["layout"] for r in rows) == ["contiguous", "hilbert", "zigzag"]
    for r in rows:
        _finite(r, "fwd_MB", "fwdbwd_MB", "dense_fwd_MB", "ratio", "pairs_max_over_mean")
        assert float(r["ratio"]) <= 1 and float(r["pairs_max_over_mean"]) >= 1, r


def bench_ring(patterns, tmp_path, **_):
    # world size 1 (no process group); the two-rank run: tests/test_bench_ring.py
    assert _script("bench_ring").main(
        ["--mode", "correctness", "--seq-len", "96", "--layouts", "zigzag", "--device", "cpu",
         "--heads", str(HQ), "--kv-heads", str(HKV), "--head-dim", str(D), "--pattern",
         str(patterns[0]), "--out-dir", str(tmp_path)]) == 0
    rows = _csv(tmp_path / "bench_ring_correctness_cpu.csv")
    assert len(rows) == 4 and all(r["world_size"] == "1" for r in rows)  # out, dq, dk, dv
    for r in rows:
        assert r["ok"] == "True", r
        _finite(r, "ring_rel", positive=False)


def profile_step(assets, patterns, **_):
    model, _ = assets
    rows = _script("profile_step").main(["--device", "cpu", "--model", str(model), "--seq",
                                         "64", "--patterns", str(patterns[0]), "--steps", "1"])
    assert [r["method"] for r in rows] == ["sdpa", "hybrid"]
    for r in rows:
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0, r


def padded_batch(assets, patterns, **_):
    model, corpus = assets
    text = next((corpus / "heldout").glob("*.txt"))
    res = _script("padded_batch").main([str(model), "--pattern", str(patterns[0]), "--text",
                                        str(text), "--long", "160", "--short", "120"])
    assert all(math.isfinite(v) for v in res.values()), res
    # a left-padded row is the same function as the row alone (within float32 rounding)
    assert res["max_logit_diff"] < 1e-3, res


def kernel_resources(patterns, tmp_path, **_):
    """Compiled for sm_90 with ptxas (no GPU): a process of its own, without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "resources.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH_DIR / "kernel_resources.py"), "--seq", "256", "--hq",
         str(HQ), "--hkv", str(HKV), "--dim", str(D), "--forward-only", "--pattern",
         str(patterns[0]), "--csv", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if proc.returncode == 2 and "ptxas" in proc.stderr:
        pytest.skip("this Triton install ships no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _csv(out)
    assert rows and {r["kernel"] for r in rows} == {"_fwd_kernel"}
    # the sliding configs (sparse part), and the dense heads' slice: one plain config
    assert {"SLIDING=1" in r["variant"] for r in rows} == {True, False}
    for r in rows:
        _finite(r, "registers", "shared", "launches")


COMMANDS = {
    "cli-show-pattern": cli_show_pattern,
    "cli-eval": cli_eval,
    "cli-bench-model": cli_bench_model,
    "cli-bench-attention": cli_bench_attention,
    "cli-bench-cpu": cli_bench_cpu,
    "cli-bench-generate": cli_bench_generate,
    "cli-quality": cli_quality,
    "kernel_timing": kernel_timing,
    "dense_heads": dense_heads,
    "host_overhead": host_overhead,
    "decode_cpu": decode_cpu,
    "ring_volume": ring_volume,
    "bench_ring": bench_ring,
    "profile_step": profile_step,
    "padded_batch": padded_batch,
    "kernel_resources": kernel_resources,
}
MARKS = {
    # compiles kernels with ptxas: ~25-40 s on 2 cores
    "kernel_resources": pytest.mark.slow,
}


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")  # eager flex, on purpose
@pytest.mark.parametrize("command", [pytest.param(c, id=c, marks=MARKS.get(c, ()))
                                     for c in COMMANDS])
def test_command_runs_with_dense_heads_sinks_sliding(command, request, tmp_path, capsys,
                                                     monkeypatch, patterns):
    kw = dict(capsys=capsys, patterns=patterns, tmp_path=tmp_path, monkeypatch=monkeypatch)
    if command in ("cli-quality", "profile_step", "padded_batch"):
        kw["assets"] = request.getfixturevalue("assets")
    COMMANDS[command](**kw)


def _zoo():
    spec = importlib.util.spec_from_file_location("smoke_model_zoo", REPO / "examples" / "model_zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    return zoo


# one family of each other outcome and reason: cross-attention, a mask read as a tensor, a window
# the config does not declare, position bias, sinks computed per query (those that run:
# USERS_HAVE); each where the installed release has it (inkling2_text: from 5.2x)
ZOO_SAMPLE = ("bert", "doge", "moshi", "inkling_text", "inkling2_text")
# The decoder families a user tried with us in issue 35 (plain, sliding or chunked layers,
# learned sinks, soft-capping, MLA head sizes): each runs, with the dense pattern equal to its
# baseline to float32's rounding (40 tokens, rows of <= 40 keys, 64 features). Not Falcon: its
# modeling code calls the attention interface from Transformers 5.25 only (runs there)
USERS_HAVE = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma", "olmo2", "granite", "starcoder2",
              "gpt2", "gpt_neox", "mixtral", "apertus", "seed_oss", "gpt_bigcode", "phi",
              "mistral", "ministral", "gemma3_text", "cohere2", "exaone4", "olmo3", "llama4_text",
              "gemma2", "gpt_oss", "deepseek_v3")


def _inventory(release: tuple) -> tuple:
    """``(its release, path)``: the model-zoo inventory of ``release`` (``(5, 25)``), else of the
    newest earlier release (else of the earliest there is)."""
    paths = (REPO / "docs" / "bench" / "model_zoo").glob("zoo_transformers_*_cpu.csv")
    found = sorted((tuple(int(x) for x in p.name.split("_")[2].split(".")), p) for p in paths)
    assert found, "no model-zoo inventory in docs/bench/model_zoo/"
    return ([f for f in found if f[0] <= release] or found[:1])[-1]


def test_every_family_of_the_installed_transformers_is_classified():
    """The model-zoo inventory of this Transformers release (``docs/bench/model_zoo/``) names
    every decoder family it has; a family of each outcome gives the recorded outcome again. A
    release without one (the next) is held to the newest earlier inventory for the families both
    have, with a warning that names the new families and the command that makes its own."""
    import transformers

    release = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    (recorded_in, path), wanted = _inventory(release), "%d.%d" % release
    recorded = {r["family"]: r for r in _csv(path)}
    zoo = _zoo()
    families = set(zoo.families())
    both = families & set(recorded)
    if recorded_in == release:
        assert families == set(recorded), \
            f"families not classified: {sorted(families ^ set(recorded))}"
    else:
        warnings.warn(f"no model-zoo inventory for transformers {wanted}: its families are held to "
                      f"{path.name} where both have them; not classified: "
                      f"{sorted(families - set(recorded))}; run python examples/model_zoo.py "
                      f"--csv docs/bench/model_zoo/zoo_transformers_{wanted}_cpu.csv (see the .md "
                      f"beside {path.name})")
    sample = [n for n in ZOO_SAMPLE if n in both]
    assert sample, f"no family of {ZOO_SAMPLE} in both {path.name} and this release"
    for name in sample:
        row = zoo.try_family(name)
        assert (row["outcome"], row["detail"][:60]) == \
            (recorded[name]["outcome"], recorded[name]["detail"][:60]), name
    assert all(recorded[name]["outcome"] == "runs" for name in USERS_HAVE if name in both)


@pytest.mark.parametrize("family", USERS_HAVE)
def test_the_families_users_have_run(family):
    """A tiny random model of the family: the dense pattern gives its baseline's logits (sdpa's,
    or eager's where it offers no sdpa), a sparse pattern trains, ``generate()`` runs."""
    row = _zoo().try_family(family)
    assert row["outcome"] == "runs", row["detail"]
    assert float(row["rel_diff"]) <= model_tol(40, 40, 64), row


def test_model_zoo_sorts_families_into_runs_and_refused(tmp_path, capsys):
    """``examples/model_zoo.py``: a family that runs (the dense pattern gives sdpa's logits), one
    we refuse in one line that says what to do, written to the CSV; the family list holds the
    decoders the other tests use."""
    zoo = _zoo()
    assert zoo.main(["inkling_text", "llama", "mistral", "--csv", str(tmp_path / "zoo.csv")]) == 0
    rows = _csv(tmp_path / "zoo.csv")
    assert [(r["family"], r["outcome"], r["baseline"]) for r in rows] == [
        ("inkling_text", "refused", "sdpa"), ("llama", "runs", "sdpa"), ("mistral", "runs", "sdpa")]
    # float32 logits relative to their largest: 40 tokens, rows of <= 40 keys, 64 features
    # (mistral: every layer keeps a window of 16 tokens, which the 40 cross)
    assert all(float(r["rel_diff"]) <= model_tol(40, 40, 64) for r in rows[1:])
    assert "position bias" in rows[0]["detail"] and "\n" not in rows[0]["detail"]
    assert "2 runs, 1 refused, 0 not built, 0 crash of 3 families" in capsys.readouterr().out
    assert {"llama", "mistral", "qwen2", "gpt2"} <= set(zoo.families())
