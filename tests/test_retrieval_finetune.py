"""Retrieval examples in the fine-tune data (issue 26, item 5): the schedule, the blocks (loss on
the answer only), ``finetune --retrieval-mix`` alone and sequence-parallel, the Trainer helper,
``quality --finetune-args`` and the measurement script's ``--smoke`` run."""

import csv
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import model_tol
from helpers import run_finetune_here
from hf_hilbert_attn.tools.evaluation.corpus import (build_char_tokenizer, build_default_model,
                                               builtin_corpus)
from hf_hilbert_attn.tools.evaluation.passkey import passkey_prompts
from hf_hilbert_attn.tools.evaluation.retrieval_train import (TRAIN_SEED, TRAIN_TASKS,
                                                        RetrievalSchedule, check_tasks,
                                                        retrieval_block, retrieval_examples)
from hf_hilbert_attn.tools.evaluation.ruler import RulerGenerator

ROOT = Path(__file__).resolve().parents[1]
PATTERN_YAML = "segment_lengths: [16, 64, 128]\ndilation_rates: [1, 2, 4]\n"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tok):
    """A tiny random Llama directory (character tokenizer), a corpus with train/ and heldout/,
    and a small pattern file."""
    root = tmp_path_factory.mktemp("rft")
    build_default_model(tok, seed=5).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    for part, seed in (("train", 1), ("heldout", 2)):
        (root / "corpus" / part).mkdir(parents=True)
        for i, doc in enumerate(builtin_corpus(6000, seed=seed)):
            (root / "corpus" / part / f"{i:03d}.txt").write_text(doc)
    (root / "p.yaml").write_text(PATTERN_YAML)
    return root


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _run(cmd, timeout=180):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- schedule
def test_schedule_fraction_spread_and_determinism():
    for mix in (0.1, 0.25, 0.5, 0.9):
        s = RetrievalSchedule(mix, seed=3)
        flags = [s.is_retrieval(k) for k in range(1000)]
        for n in (7, 100, 1000):  # any prefix holds floor(n * mix + phase) of them
            assert abs(sum(flags[:n]) - n * mix) < 1, (mix, n)
        at = [k for k, f in enumerate(flags) if f]
        gaps = {j - i for i, j in zip(at, at[1:])}
        assert max(gaps) - min(gaps) <= 1, (mix, gaps)  # evenly spread
        assert flags == [RetrievalSchedule(mix, seed=3).is_retrieval(k) for k in range(1000)]
        # the text steps count on from where a run without the mix would be
        texts = [s.text_step(k) for k in range(1000) if not flags[k]]
        assert texts == list(range(len(texts)))
    phases = {RetrievalSchedule(0.25, seed=k).phase for k in range(5)}
    assert len(phases) == 5  # the seed moves the retrieval steps
    assert not any(RetrievalSchedule(0.0).is_retrieval(k) for k in range(100))
    for bad in (1.0, -0.1, 2):
        with pytest.raises(ValueError, match=r"fraction in \[0, 1\)"):
            RetrievalSchedule(bad)
    with pytest.raises(ValueError, match="unknown retrieval task 'nope'; known: niah_single"):
        check_tasks(["passkey", "nope"])


def test_step_batch_keeps_the_text_order(tok):
    from hf_hilbert_attn.tools.finetune_data import RetrievalMix, batch_for_step, step_batch

    blocks = torch.arange(40 * 512).view(40, 512)
    mix = RetrievalMix(tok, 0.3, ("passkey", "niah_single"), 512, seed=0)
    text, n_retrieval = [], 0
    for step in range(30):
        ids, labels, retrieval = step_batch(blocks, step, 0, 1, 2, 0, mix)
        assert ids.shape == labels.shape == (2, 512)
        if retrieval:
            n_retrieval += 1
            assert (labels != -100).any(dim=1).all() and (labels != ids).any()
        else:
            assert torch.equal(labels, ids)
            text.append(ids)
    assert n_retrieval == mix.schedule.before(30) == mix.blocks_in(30, 2) // 2
    plain = [batch_for_step(blocks, k, 0, 1, 2, 0) for k in range(len(text))]
    assert all(torch.equal(a, b) for a, b in zip(text, plain))


# ----------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("seq_len", [512, 777])
def test_blocks_end_with_the_answer_and_only_it_is_labelled(tok, seq_len):
    gen = RulerGenerator(tok, seed=TRAIN_SEED)
    seen = []
    for r in range(len(TRAIN_TASKS) + 1):
        ids, labels, task = retrieval_block(gen, r, seq_len)
        assert task == TRAIN_TASKS[r % len(TRAIN_TASKS)]  # cycled
        assert len(ids) == len(labels) == seq_len
        assert ids[-1] == tok.eos_token_id and labels[-1] == -100
        answer = [i for i, (t, y) in enumerate(zip(ids, labels)) if y != -100]
        assert answer == list(range(answer[0], seq_len - 1)), "one span, right before EOS"
        assert [labels[i] for i in answer] == [ids[i] for i in answer]  # unshifted
        text = tok.decode([ids[i] for i in answer])
        assert text.strip().rstrip(".").replace(",", "").replace(" ", "").isdigit(), text
        # the prompt before it asks for exactly this: the same sample, teacher-forced
        prompt = tok.decode(ids[:answer[0]], skip_special_tokens=True)
        assert prompt.rstrip().endswith((" is", " are")), prompt[-60:]
        seen.append((ids, labels))
    again = RulerGenerator(tok, seed=TRAIN_SEED)
    assert [retrieval_block(again, r, seq_len)[:2] for r in range(len(seen))] == seen
    other = RulerGenerator(tok, seed=TRAIN_SEED + 1)
    assert retrieval_block(other, 0, seq_len)[0] != seen[0][0]


def test_blocks_are_not_evaluation_prompts(tok):
    """The passkey blocks of the fine-tune use keys of their own (the eval uses seed 0)."""
    eval_keys = {p.key for L in (512,) for p in passkey_prompts(tok, L, [0, .25, .5, .75, 1], 4)}
    rows = retrieval_examples(tok, 40, 512, tasks=("passkey",))
    keys = {tok.decode([i for i, y in zip(r["input_ids"], r["labels"]) if y != -100]).strip(" .")
            for r in rows}
    assert len(keys) == 40 and not keys & eval_keys


def test_short_blocks_are_padded_on_the_left(tok):
    """common_words fills at most the length asked: the block is padded before its prompt."""
    rows = retrieval_examples(tok, 1, 600, tasks=("common_words",))
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    assert len(ids) == 600 and ids[-1] == tok.eos_token_id and labels[-2] != -100
    assert ids[0] == tok.pad_token_id and labels[0] == -100


def test_too_short_or_unknown_is_one_line(tok, capsys):
    from hf_hilbert_attn.tools.evaluation._args import InputError
    from hf_hilbert_attn.tools.finetune import main
    from hf_hilbert_attn.tools.finetune_data import RetrievalMix

    with pytest.raises(InputError, match="--retrieval-tasks niah_multivalue at --seq-len 200: "
                                         "length .* is too short"):
        RetrievalMix(tok, 0.5, ("passkey", "niah_multivalue"), 200, 0).check()
    for argv, message in ((["--retrieval-mix", "1"], "--retrieval-mix must be a fraction in "
                                                     r"\[0, 1\), got 1"),
                          (["--retrieval-tasks", "passkey", "needle"],
                           "--retrieval-tasks: unknown retrieval task 'needle'; known: ")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search("finetune.py: error: " + message, err), err


# ----------------------------------------------------------------------------- finetune.py
def _ft_args(assets, out, seed, *extra):
    return ["-m", "hf_hilbert_attn.tools.finetune", "--model", str(assets / "model"), "--data",
            str(assets / "corpus" / "train"), "--pattern", str(assets / "p.yaml"), "--seq-len",
            "256", "--max-steps", "3", "--save-every", "0", "--lr", "1e-3", "--seed", str(seed),
            "--retrieval-mix", "0.5", "--retrieval-tasks", "passkey", "niah_single",
            "--output-dir", str(out), "--cpu", *extra]


@pytest.mark.multiprocess
def test_finetune_retrieval_mix_loss_on_the_answer_and_sequence_parallel(assets, tok, tmp_path,
                                                                         caplog):
    """A retrieval step's loss is the model's loss on the answer tokens of its block (checked on
    the first step, from the same weights), and 2 sequence-parallel ranks (labels sharded with
    the ids) give the 1-process losses (that run: in this process, helpers.run_finetune_here)."""
    from transformers import AutoModelForCausalLM

    import hf_hilbert_attn
    from hf_hilbert_attn.tools.finetune import main
    from hf_hilbert_attn.tools.finetune_data import RetrievalMix

    seed = next(s for s in range(50) if RetrievalSchedule(0.5, s).is_retrieval(0))
    args = _ft_args(assets, tmp_path / "one", seed)
    assert args[:2] == ["-m", "hf_hilbert_attn.tools.finetune"]
    with caplog.at_level(logging.INFO, logger="finetune"):  # its summary lines
        run_finetune_here(main, args[2:])
    log = _log(tmp_path / "one")
    assert [r["retrieval"] for r in log][0] == 1 and sum(r["retrieval"] for r in log) in (1, 2)
    stats = json.loads((tmp_path / "one" / "train_stats.json").read_text())
    assert stats["retrieval_blocks"] == sum(r["retrieval"] for r in log)
    assert stats["retrieval_mix"] == 0.5 and stats["retrieval_tasks"] == ["passkey",
                                                                           "niah_single"]
    assert f"{stats['retrieval_blocks']} of 3 blocks were retrieval examples" in caplog.text

    model = AutoModelForCausalLM.from_pretrained(assets / "model",
                                                 attn_implementation="hilbert_dilated")
    hf_hilbert_attn.configure(model, str(assets / "p.yaml"))
    ids, labels = RetrievalMix(tok, 0.5, ("passkey", "niah_single"), 256, seed).batch(0, 0, 1, 1)
    n = int((labels != -100).sum())
    assert 5 <= n <= 8  # " 12345." in characters
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss.item()
    assert log[0]["loss"] == pytest.approx(expected, rel=model_tol(n, 256, 64))

    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
          "2", *_ft_args(assets, tmp_path / "sp2", seed)], timeout=240)
    sp = [r["loss"] for r in _log(tmp_path / "sp2")]
    assert sp == pytest.approx([r["loss"] for r in log], rel=model_tol(256, 256, 64) * 4)


# ----------------------------------------------------------------------------- Trainer
def test_retrieval_examples_train_with_the_plain_trainer(assets, tok, tmp_path):
    datasets = pytest.importorskip("datasets")  # optional (the tools extra)
    from transformers import (AutoModelForCausalLM, Trainer, TrainingArguments,
                              default_data_collator)

    import hf_hilbert_attn

    rows = retrieval_examples(tok, 3, 256, tasks=("passkey", "niah_single"), seed=TRAIN_SEED)
    assert rows == retrieval_examples(tok, 3, 256, tasks=("passkey", "niah_single"))
    text = tok("".join(builtin_corpus(3000, seed=7)), add_special_tokens=False)["input_ids"]
    text_rows = [{"input_ids": text[i:i + 256], "labels": text[i:i + 256]}
                 for i in range(0, 3 * 256, 256)]
    ds = datasets.concatenate_datasets([datasets.Dataset.from_list(text_rows),
                                        datasets.Dataset.from_list(rows)]).shuffle(seed=0)
    batch = default_data_collator([rows[0]])  # the collator keeps the answer-only labels
    assert (batch["labels"] != -100).sum() == sum(y != -100 for y in rows[0]["labels"])
    model = AutoModelForCausalLM.from_pretrained(assets / "model",
                                                 attn_implementation="hilbert_dilated")
    hf_hilbert_attn.configure(model, str(assets / "p.yaml"))
    args = TrainingArguments(output_dir=str(tmp_path / "t"), max_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=default_data_collator)
    out = trainer.train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))


# ----------------------------------------------------------------------------- quality, script
def test_quality_passes_retrieval_mix_to_the_finetune(assets, tmp_path):
    from hf_hilbert_attn.tools.cli import main

    (tmp_path / "m.yaml").write_text(f"- {{label: small, pattern: {assets / 'p.yaml'}}}\n")
    code = main(["quality", "--model", str(assets / "model"), "--corpus",
                 str(assets / "corpus"), "--methods", str(tmp_path / "m.yaml"), "--out",
                 str(tmp_path / "q"), "--stages", "finetuned", "--finetune-steps", "4",
                 "--finetune-seq-len", "512", "--finetune-warmup", "0", "--finetune-args",
                 "--retrieval-mix 0.25", "--tasks", "perplexity", "--lengths", "64",
                 "--ppl-tokens", "256", "--no-plots", "--no-progress"])
    assert code == 0
    ft = tmp_path / "q" / "finetune" / "small"
    assert "--retrieval-mix 0.25" in (ft / "command.txt").read_text()
    stats = json.loads((ft / "train_stats.json").read_text())
    assert stats["retrieval_mix"] == 0.25 and stats["retrieval_blocks"] == 1


@pytest.mark.timeout(240)  # as the script's process had
def test_retrieval_finetune_script_smoke(tmp_path, capsys, monkeypatch):
    # the script's main() in this process (its fine-tunes are still processes of their own), as
    # tests/test_calibrate.py runs retrieval_study.py's: it puts its folder on sys.path
    import importlib.util

    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location(
        "retrieval_finetune", ROOT / "examples/benchmarks/retrieval_finetune.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # the default row is the calibrated one's code path, less 2 processes
    assert script.main(["--smoke", "--out", str(tmp_path), "--jobs", "4", "--rows", "dense",
                        "calibrated"]) == 0
    stdout = capsys.readouterr().out

    rows = list(csv.DictReader((tmp_path / "retrieval_finetune.csv").open()))
    methods = {r["method"] for r in rows}
    assert methods == {f"{m}_mix{x}" for m in ("dense", "calibrated")
                       for x in ("0", "0.25")}, methods
    assert {r["task"] for r in rows} == {"passkey", "niah_single", "niah_multikey",
                                         "niah_multivalue", "variable_tracking", "perplexity"}
    blocks = {r["method"]: int(r["retrieval_blocks"]) for r in rows}
    assert all(blocks[m] == (1 if m.endswith("0.25") else 0) for m in methods), blocks
    cfg = json.loads((tmp_path / "finetune" / "calibrated_mix0.25" / "final" /
                      "config.json").read_text())
    assert any(cfg["hilbert_attn"]["layer_dense_kv_heads"]), "the hybrid was fine-tuned"
    md = (tmp_path / "retrieval_finetune.md").read_text()
    assert "| calibrated_mix0.25 | 0.25 |" in md and "FAILED" not in stdout
