"""Calibration of dense key/value heads: the budget, the needle-mass probe against eager
attention weights, the ablation's greedy order, the config round trip, the CLI and the
retrieval study's smoke run."""

import json
import warnings
from pathlib import Path

import pytest
import torch

import hf_hilbert_attn as H
from hf_hilbert_attn.tools.evaluation import calibrate as cal
from hf_hilbert_attn.tools.evaluation.corpus import build_char_tokenizer, build_default_model
from hf_hilbert_attn.tools.evaluation.ruler import RulerGenerator, word_list

ROOT = Path(__file__).resolve().parents[1]
PATTERN = H.DilatedPattern([64, 256], [1, 4], sink_tokens=1, window="sliding")
LEN = 480  # beyond the pattern's dense window (64), short enough for a CPU


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok, layers=3):
    model = build_default_model(tok, seed=11, num_hidden_layers=layers,
                                max_position_embeddings=2048)
    return H.configure(model, PATTERN)


def _dense_of(config, layers):
    return [list(H.get_pattern(config, i).dense_kv_heads) for i in range(layers)]


def test_needle_mass_respects_budget_and_writes_config(tok):
    model = _model(tok)  # 3 layers x 2 kv heads
    res = cal.calibrate(model, tok, budget=0.34, method="needle_mass", lengths=[LEN],
                        depths=[0.3], progress=False)
    assert sum(len(h) for h in res.per_layer) == 2 == len(res.chosen[:2])
    assert _dense_of(model.config, 3) == res.per_layer
    assert model.config._attn_implementation == "hilbert_dilated"  # the probe is undone
    assert res.forwards >= 1 and res.prompts == 3 and res.seconds > 0
    flat = sorted((s, (i, j)) for i, row in enumerate(res.scores) for j, s in enumerate(row))
    assert set(res.chosen) == {c for _, c in flat[-2:]}  # the two largest masses
    assert 0 < cal.model_density(model.config, 4096) < 1
    # budget 0: nothing; budget 1: everything, and then the density is dense
    none = cal.calibrate(model, tok, budget=0.0, method="needle_mass", lengths=[LEN],
                         depths=[0.3], progress=False)
    assert none.per_layer == [[], [], []]
    full = cal.calibrate(model, tok, budget=1.0, method="needle_mass", lengths=[LEN],
                         depths=[0.3], progress=False, apply=False)
    assert full.per_layer == [[0, 1]] * 3 and full.density == 1.0
    assert _dense_of(model.config, 3) == [[], [], []]  # apply=False left the config as it was
    with pytest.raises(ValueError, match="budget"):
        cal.calibrate(model, tok, budget=1.5, method="needle_mass", lengths=[LEN])
    with pytest.raises(ValueError, match="method"):
        cal.calibrate(model, tok, budget=0.5, method="gates", lengths=[LEN])


def test_needle_mass_probe_matches_eager_attention(tok):
    model = _model(tok, layers=2)
    s = RulerGenerator(tok, words=word_list("builtin")[0], seed=1).sample("niah_single", 300,
                                                                        0.4, 0, 0)
    mass = cal._needle_mass(model, [s], tok.pad_token_id, 10_000, None)  # [layers, kv]
    ids = torch.tensor([s.input_ids + s.answer_ids])
    eager = build_default_model(tok, seed=11, num_hidden_layers=2, max_position_embeddings=2048)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        att = eager(input_ids=ids, output_attentions=True).attentions  # [1, Hq, S, S] per layer
    q = [len(s.input_ids) - 1 + t for b, e in s.item_spans for t in range(b, e)]
    (nb, ne), = s.needle_spans
    for layer, a in enumerate(att):
        per_q_head = a[0, :, q, nb:ne].sum(-1).mean(-1)  # [Hq]
        want = per_q_head.view(2, 2).mean(-1)  # GQA 4 query heads -> 2 kv heads
        torch.testing.assert_close(mass[layer].float(), want, atol=1e-5, rtol=1e-4)


def test_ablation_order_budget_and_round_trip(tok, tmp_path):
    model = _model(tok)
    res = cal.calibrate(model, tok, budget=0.2, order_budget=0.5, method="ablation",
                        lengths=[LEN], tasks=("passkey",), depths=[0.2], rescore=1,
                        progress=False)
    assert len(res.chosen) == 3 and len(set(res.chosen)) == 3  # order to the larger budget
    assert res.per_layer == cal.per_layer_from(res.chosen[:1], 3)  # config: budget 0.2 -> 1
    assert res.per_layer_for(0.5) == cal.per_layer_from(res.chosen, 3)
    assert res.baseline.keys() == res.final.keys() == {"logprob", "score"}
    # baseline + 6 single heads + 2 re-scored + the final measure: a forward each
    assert res.forwards == 10
    gains = {(i, j): g for i, row in enumerate(res.scores) for j, g in enumerate(row)}
    assert res.chosen[0] == max(gains, key=gains.get)
    assert "dense kv heads by layer" in res.summary()
    # the choice comes back with from_pretrained, and so do the logits
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hilbert_dilated")
    assert _dense_of(back.config, 3) == res.per_layer
    ids = torch.randint(4, 90, (1, 300))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)


def _save(tok, path):
    model = _model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def test_cli_copy_and_in_place(tok, tmp_path, capsys):
    from hf_hilbert_attn.tools.cli import main

    src, out = tmp_path / "model", tmp_path / "calibrated"
    _save(tok, src)
    before = json.loads((src / "config.json").read_text())
    assert main(["calibrate", str(src), "--budget", "0.34", "--method", "needle_mass",
                 "--lengths", str(LEN), "--out", str(out), "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert sum(len(h) for h in cfg["hilbert_attn"]["layer_dense_kv_heads"]) == 2
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert json.loads((src / "config.json").read_text()) == before  # the source is untouched
    report = json.loads((out / cal.REPORT_FILE).read_text())
    assert report["method"] == "needle_mass" and report["per_layer"] == \
        cfg["hilbert_attn"]["layer_dense_kv_heads"]
    # in place: only the hilbert_attn entry changes
    assert main(["calibrate", str(src), "--budget", "0.2", "--method", "needle_mass",
                 "--lengths", str(LEN), "--no-progress"]) == 0
    after = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in after.items() if k != "hilbert_attn"} == \
        {k: v for k, v in before.items() if k != "hilbert_attn"}
    assert sum(len(h) for h in after["hilbert_attn"]["layer_dense_kv_heads"]) == 1
    # a length too short for the prompts and a bad budget are usage errors (exit 2)
    with pytest.raises(SystemExit) as e:
        main(["calibrate", str(src), "--budget", "0.2", "--lengths", "100"])
    assert e.value.code == 2 and "passkey context length 100 is too short" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", str(src), "--budget", "1.5"])
    assert e.value.code == 2


@pytest.fixture
def saved(tok, tmp_path_factory):
    src = tmp_path_factory.mktemp("calibrate") / "model"
    _save(tok, src)
    return src


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], r"--budget must be in \(0, 1\], got 0.0 \(0 makes no head dense"),
    # 3 layers x 2 key/value heads: 0.1 rounds down to no dense head
    (["--budget", "0.1"], r"--budget 0.1 makes no key/value head dense \(3 layers x 2 heads: "
                          r"at least 0.167 makes one\): nothing to calibrate"),
    # PATTERN is dense within 64 tokens: a 64-token prompt cannot tell heads apart
    (["--budget", "0.5", "--lengths", "64", "480"],
     r"--lengths 64: a prompt at or below the pattern's dense window \(64 tokens\) runs the "
     r"same .*give lengths above 64 \(default: 128 256\)"),
    (["--budget", "0.5", "--pattern", "1024,4096:1,4", "--lengths", "480"],
     r"--lengths 480: .*dense window \(1024 tokens\)"),
])
def test_cli_refuses_what_cannot_calibrate_before_loading(saved, capsys, monkeypatch, argv,
                                                          message):
    # one error line (after the usage), exit 2, and the model is never loaded
    import re

    import transformers

    from hf_hilbert_attn.tools.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(SystemExit) as e:
        main(["calibrate", str(saved), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hf-hilbert-attn calibrate: error: ") and "Traceback" not in err
    assert re.search(message, last), last


def test_cli_missing_model_is_a_usage_error(capsys, tmp_path):
    # exit 2, as for eval and quality (it was 1 here)
    from hf_hilbert_attn.tools.cli import main

    for path, message in ((tmp_path / "nope", "model directory not found: "),
                          (tmp_path, "is not a model directory (no config.json)")):
        with pytest.raises(SystemExit) as e:
            main(["calibrate", str(path)])
        assert e.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_cli_progress_lines_on_a_log(saved, tmp_path, capsys, monkeypatch):
    # stderr not a terminal (capsys): a line per stage, none with --no-progress
    from hf_hilbert_attn.tools.cli import main

    monkeypatch.setenv("HF_HILBERT_PROGRESS_SECONDS", "0")  # every step
    out = tmp_path / "calibrated"
    argv = ["calibrate", str(saved), "--budget", "0.34", "--lengths", str(LEN), "--out", str(out),
            "--device", "cpu"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"calibrate: loading {saved} (cpu, float32)"
    assert err[1] == f"calibrate: needle_mass, budget 0.34, prompts at {LEN} tokens"
    assert err[2] == "calibrate (needle mass): started, 0/15 prompts"
    assert any(line.startswith("calibrate (needle mass): 15/15 prompts, ") for line in err)
    assert err[-1].startswith("calibrate (needle mass): done, 15/15 prompts in ")
    assert main(argv + ["--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def _study():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "retrieval_study", ROOT / "examples/benchmarks/retrieval_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_retrieval_study_coverage_patterns():
    study = _study()
    pats = study.coverage_patterns(H.get_pattern(type("C", (), {"hilbert_attn": None})()), 9, 3)
    assert pats["all_mode"].query_dilation == "all"
    assert pats["cap_g"].dilation_rates == (1, 2, 3) and pats["cap_g"].segment_lengths[-1] == 65536
    assert max(pats["cap_hq"].dilation_rates) == 9


@pytest.mark.slow
def test_retrieval_study_smoke(tmp_path, capsys):
    out = tmp_path / "study"
    assert _study().main(["--smoke", "--out", str(out), "--budgets", "0.3", "--no-coverage"]) == 0
    for name in ("retrieval.csv", "retrieval.md", "retrieval_heatmap.png",
                 "calibration_needle_mass.json", "calibration_ablation.json"):
        assert (out / name).is_file(), name
    md = (out / "retrieval.md").read_text()
    for row in ("| dense |", "| default |", "| needle_mass@0.3 |", "| ablation@0.3 |"):
        assert row in md
    assert "calibration ablation" in capsys.readouterr().out
