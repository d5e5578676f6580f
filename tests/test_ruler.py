"""RULER-style tasks: generation (deterministic, exact lengths, evidence at its depth, answers
that decode to their items and are right) and teacher-forced scoring (oracle and wrong models,
per-item credit, batching that changes nothing)."""

import csv
import math
import re
from collections import Counter

import pytest
import torch

from hf_hilbert_attn.tools.evaluation.corpus import (build_char_tokenizer, build_default_model,
                                               builtin_corpus)
from hf_hilbert_attn.tools.evaluation.passkey import teacher_forced_predictions
from hf_hilbert_attn.tools.evaluation.ruler import (ALL_TASKS, DEPTH_FREE, TASKS, RulerGenerator,
                                                    evaluate_ruler, ruler_samples, score_samples,
                                                    word_list)
from hf_hilbert_attn.tools.evaluation.ruler_report import plot_ruler, summarize, write_ruler_csv


@pytest.fixture(scope="module")
def char():
    return build_char_tokenizer()


def _bpe_tokenizer():
    """A small byte-level BPE (as GPT-2 / SmolLM2 tokenise: a space merges into the next word),
    trained here on generated text, so words and numbers split into several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(builtin_corpus(30_000) + ["The special magic number for 1234 is"],
                          trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


@pytest.fixture(scope="module", params=["char", "bpe"])
def tok(request, char):
    return char if request.param == "char" else _bpe_tokenizer()


@pytest.fixture(scope="module")
def words():
    return word_list("builtin")[0]


L = 1600


def test_word_list_sources(words):
    assert len(words) > 250 and words == sorted(words)
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)
    got, source = word_list("auto")
    assert source in ("wonderwords", "builtin") and len(got) >= len(words)
    with pytest.raises(ValueError, match="word source"):
        word_list("nope")


@pytest.mark.parametrize("task", ALL_TASKS)
def test_samples_are_deterministic_exact_and_answer_their_question(tok, words, task):
    gen = RulerGenerator(tok, words=words, seed=3)
    a = gen.sample(task, L, 0.5, 2, 1)
    b = RulerGenerator(tok, words=words, seed=3).sample(task, L, 0.5, 2, 1)
    assert (a.input_ids, a.answer_ids, a.items) == (b.input_ids, b.answer_ids, b.items)
    other = RulerGenerator(tok, words=words, seed=4).sample(task, L, 0.5, 2, 1)
    assert other.input_ids != a.input_ids
    if task in DEPTH_FREE:
        assert math.isnan(a.depth) and L - 40 <= len(a.input_ids) <= L
    else:
        assert len(a.input_ids) == L
    # every item is spelled by its answer tokens; spans are ordered and inside the answer
    assert len(a.items) == len(a.item_spans) >= 1
    for item, (s, e) in zip(a.items, a.item_spans):
        assert 0 <= s < e <= len(a.answer_ids)
        assert tok.decode(a.answer_ids[s:e]).strip() == item
    assert tok.decode(a.answer_ids).endswith("\n" if task == "common_words" else ".")
    prompt = tok.decode(a.input_ids)
    if task == "common_words":
        listed = re.findall(r"^\d+\. ([a-z]+)$", prompt, flags=re.M)
        ranked = [w for w, _ in Counter(listed).most_common(4)]
        counts = Counter(listed)
        assert a.items == ranked[:3] and counts[ranked[2]] > counts[ranked[3]]
    elif task == "variable_tracking":
        assign = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt))
        value = re.search(r"assigned the value (\d+)\?", prompt).group(1)

        def resolve(v):
            while assign[v].startswith("VAR"):
                v = assign[v][4:]
            return assign[v]
        assert sorted(v for v in assign if resolve(v) == value) == sorted(a.items)
    else:  # NIAH / passkey: each item sits in an evidence span, which holds the asked key
        spans = [tok.decode(a.input_ids[s:e]) for s, e in a.needle_spans]
        for item in a.items:
            assert any(item in s for s in spans), (item, spans)
        if task != "passkey":
            asked = re.findall(r"for ([a-z]+)", prompt.rsplit("\n", 1)[1])
            assert all(any(f"for {k} is" in s for s in spans) for k in asked)


@pytest.mark.parametrize("task", ["niah_single", "niah_single_text", "niah_multikey",
                                  "variable_tracking", "passkey"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_evidence_sits_at_the_asked_depth(char, words, task, depth):
    s = RulerGenerator(char, words=words).sample(task, 3000, depth, 1, 0)
    first = min(b for b, _ in s.needle_spans)
    # measured in the haystack between intro and question; snapped back to a sentence end
    assert abs(first / len(s.input_ids) - depth) < 0.12, (first, len(s.input_ids))


def test_text_haystack_uses_the_documents(char, words):
    docs = ["Zebra crossings are striped. " * 40, "Quartz watches tick. " * 40]
    s = RulerGenerator(char, documents=docs, words=words).sample("niah_single_text", 900,
                                                                 0.5, 0, 0)
    text = char.decode(s.input_ids)
    assert "Zebra crossings" in text or "Quartz watches" in text
    assert "grass is green" not in text


def test_bad_inputs(char, words):
    gen = RulerGenerator(char, words=words)
    with pytest.raises(ValueError, match="unknown RULER task"):
        gen.sample("nope", 1000, 0.5)
    with pytest.raises(ValueError, match="depth"):
        gen.sample("niah_single", 1000, 1.5)
    with pytest.raises(ValueError, match="too short"):
        gen.sample("niah_multikey", 100, 0.5)


# ----------------------------------------------------------------------------- scoring
class _StubLM(torch.nn.Module):
    """A causal 'model' whose argmax at each position is ``next_token(ids, t)``."""

    def __init__(self, vocab: int, next_token):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.next_token = vocab, next_token
        self.calls = []

    def forward(self, input_ids, logits_to_keep=0, use_cache=False, **_):
        B, T = input_ids.shape
        self.calls.append(tuple(input_ids.shape))
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            for t in range(T):
                logits[b, t, self.next_token(input_ids[b], t)] = 1.0
        keep = logits_to_keep or T
        return type("Out", (), {"logits": logits[:, -keep:]})()


def _oracle(pad):
    return lambda ids, t: int(ids[t + 1]) if t + 1 < len(ids) else pad


@pytest.fixture(scope="module")
def samples(tok, words):
    gen = RulerGenerator(tok, words=words, seed=1)
    return ruler_samples(gen, ALL_TASKS, [700, 900], [0.25, 0.75], 1)


def test_oracle_scores_one_and_wrong_model_zero(tok, samples):
    pad = tok.pad_token_id
    vocab = len(tok)
    rows = score_samples(_StubLM(vocab, _oracle(pad)), tok, samples, max_batch_tokens=3000)
    assert [r["score"] for r in rows] == [1.0] * len(samples)
    assert all(r["predicted"] == r["expected"] for r in rows)
    hash_id = tok("#", add_special_tokens=False)["input_ids"][0]
    rows = score_samples(_StubLM(vocab, lambda ids, t: hash_id), tok, samples,
                         max_batch_tokens=3000)
    assert [r["score"] for r in rows] == [0.0] * len(samples)


def test_per_item_credit_and_overlong_items(char, words):
    gen = RulerGenerator(char, words=words, seed=2)
    s = gen.sample("niah_multivalue", 800, 0.5, 0, 0)
    pad = char.pad_token_id
    L = len(s.input_ids)
    b, e = s.item_spans[1]
    wrong = char("#", add_special_tokens=False)["input_ids"][0]
    # wrong inside item 2 only: 3 of 4 items
    miss = lambda ids, t: wrong if t == L - 1 + b else _oracle(pad)(ids, t)  # noqa: E731
    assert score_samples(_StubLM(len(char), miss), char, [s])[0]["score"] == 0.75
    # item 1 right, but the model would go on with another digit after it: not recalled
    b0, e0 = s.item_spans[0]
    seven = char("7", add_special_tokens=False)["input_ids"][0]
    more = lambda ids, t: seven if t == L - 1 + e0 else _oracle(pad)(ids, t)  # noqa: E731
    assert score_samples(_StubLM(len(char), more), char, [s])[0]["score"] == 0.75


def test_batching_changes_nothing(char, words):
    model = build_default_model(char, seed=5)
    gen = RulerGenerator(char, words=words, seed=5)
    samples = ruler_samples(gen, ["niah_single", "common_words", "niah_multiquery"], [450, 600],
                            [0.5], 1)
    prompts = [s.input_ids for s in samples]
    answers = [s.answer_ids for s in samples]
    one = teacher_forced_predictions(model, prompts, answers, max_batch_tokens=1, log_probs=True)
    many = teacher_forced_predictions(model, prompts, answers, max_batch_tokens=10_000,
                                      log_probs=True)
    for (p1, l1), (p2, l2) in zip(one, many):
        assert p1 == p2
        assert torch.allclose(torch.tensor(l1), torch.tensor(l2), atol=1e-4)
    assert len(one[0][0]) == len(answers[0]) + 1


def test_evaluate_summarize_and_report(char, words, tmp_path):
    pad = char.pad_token_id
    rows = evaluate_ruler(_StubLM(len(char), _oracle(pad)), char, tasks=TASKS,
                          lengths=[600, 700], depths=[0.0, 1.0], trials=1, words=words)
    assert len(rows) == len(TASKS) * 2 * 2
    summ = summarize(rows)
    assert {(s["task"], s["length"]) for s in summ} == {(t, L) for t in TASKS for L in (600, 700)}
    assert all(s["score"] == 1.0 and s["n"] == 2 for s in summ)
    path = write_ruler_csv(rows, tmp_path / "ruler.csv")
    assert path.read_text().splitlines()[0].startswith("task,length,depth")
    pngs = plot_ruler(rows, tmp_path)
    assert [p.name for p in pngs] == ["ruler_tasks.png", "ruler_depths.png"]
    assert all(p.stat().st_size > 1000 for p in pngs)


def test_eval_ruler_task_writes_csv_and_heat_maps(tmp_path, capsys):
    # `hf-hilbert-attn eval --tasks ruler`: every task, per method, at the passkey lengths; the
    # mean per task printed and in results.md
    from hf_hilbert_attn.tools.cli import main
    from hf_hilbert_attn.tools.evaluation.ruler import TASKS

    assert main(["eval", "--tasks", "ruler", "--lengths", "512", "--depths", "0.5", "--trials",
                 "1", "--no-sdpa", "--pattern", "tiny", "--out-dir", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "ruler.csv").open()))
    assert {r["method"] for r in rows} == {"hilbert_dilated:tiny"}
    assert sorted({r["task"] for r in rows}) == sorted(TASKS)
    assert {int(r["length"]) for r in rows} == {512}
    printed, written = capsys.readouterr().out, (tmp_path / "results.md").read_text()
    for task in TASKS:
        mean = sum(float(r["score"]) for r in rows if r["task"] == task) / sum(
            r["task"] == task for r in rows)
        line = f"| hilbert_dilated:tiny | {task} | 512 | {mean:.4g} |"
        assert line in printed and line in written, line
    assert (tmp_path / "ruler" / "hilbert_dilated_tiny" / "ruler_tasks.png").stat().st_size > 0
