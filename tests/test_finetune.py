"""Sequence-parallel training equals single-process training; finetune.py runs, resumes exactly.

Liger-Kernel-style convergence check: the same tiny Llama trains for several steps once on the
whole sequence in one process and once sharded over a gloo group (ring attention, or
head-sharded attention); the loss and every parameter gradient must agree at every step (close:
float32, different summation order; the bound comes from a float64 run of the same steps,
``conftest.assert_error_within``).
"""

import contextlib
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _dist import run_distributed
from conftest import assert_error_within, model_tol, reorder_tol
from helpers import run_finetune_here

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def _tiny_llama(seed):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_hilbert_attn
    from hf_hilbert_attn import DilatedPattern

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hilbert_dilated")
    hf_hilbert_attn.configure(model, DilatedPattern([8, 32, 64], [1, 2, 4]))
    return model


def _worker_train(rank, world, seed, layout, steps, mode="ring"):
    import hf_hilbert_attn
    from hf_hilbert_attn.integrations.accelerate import (
        average_gradients, reduce_loss, sequence_parallel_topology, shard_for_sequence_parallel)

    ref = _tiny_llama(seed)
    sp = copy.deepcopy(ref)
    exact = copy.deepcopy(ref).double()  # the same steps in float64: what both runs approximate
    pattern = hf_hilbert_attn.get_pattern(ref.config)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    topo = sequence_parallel_topology(None, world)
    assert topo.sp_size == world and topo.group is not None
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        s = 61 + 2 * step  # odd lengths: the layout pads, padding labels are -100
        ids = torch.randint(0, 128, (2, s), generator=g)
        labels = ids.clone()
        labels[torch.rand(2, s, generator=g) < 0.2] = -100
        batch = {"input_ids": ids, "labels": labels}
        if step == steps - 1:  # packed documents: positions restart at 0 per document
            cut = s // 3
            pos = torch.cat([torch.arange(cut), torch.arange(s - cut)])
            batch["position_ids"] = pos.expand(2, s)
        out_ref = ref(**batch)
        out_ref.loss.backward()
        out_exact = exact(**batch)
        out_exact.loss.backward()
        shard = shard_for_sequence_parallel(batch, topo, layout=layout, pattern=pattern)
        assert ("hilbert_doc_ids" in shard) == ("position_ids" in batch or layout == "hilbert")
        with hf_hilbert_attn.sequence_parallel(topo.group, mode=mode):
            out = sp(**shard)
        loss = reduce_loss(out.loss, topo.group)
        loss.backward()
        average_gradients(sp)  # what DDP does
        # close: the ring and the ranks' partial sums add the same float32 terms in another
        # order, so the error against float64 is the one-process run's size (conftest rule 2);
        # floor: the n-token mean (loss) or sum (gradients) in another order (rule 1)
        n = int((labels[:, 1:] != -100).sum())
        what = f"step {step} ({layout}, {mode})"
        assert_error_within("loss", loss, out_ref.loss, out_exact.loss, what=what,
                            floor=reorder_tol(n) * abs(out_exact.loss.item()))
        for (name, p_ref), (_, p_sp), (_, p_ex) in zip(ref.named_parameters(),
                                                       sp.named_parameters(),
                                                       exact.named_parameters()):
            assert_error_within(f"grad of {name}", p_sp.grad, p_ref.grad, p_ex.grad, what=what,
                                floor=reorder_tol(n) * float(p_ex.grad.abs().max()))
        opt_ref.step()
        opt_ref.zero_grad()
        # the next step starts all three from the reference's weights: each step compares one
        # computation (AdamW moves a weight by ~lr whatever its gradient's size, so float32
        # rounding of a near-zero gradient would otherwise grow into a visible weight difference)
        with torch.no_grad():
            for p_ref, p_sp, p_ex in zip(ref.parameters(), sp.parameters(), exact.parameters()):
                p_sp.copy_(p_ref)
                p_ex.copy_(p_ref)
                p_sp.grad = p_ex.grad = None
        losses.append(float(loss))
    return losses


def _worker_train_layouts(rank, world, seed, steps):
    return [_worker_train(rank, world, seed, layout, steps)
            for layout in ("zigzag", "contiguous", "hilbert")]


def test_sp_training_equals_single_process():
    res = run_distributed(_worker_train_layouts, 2, 1234, 3, timeout=240)
    assert res[0] == res[1], "exact: both ranks of the group see the same global loss"


def _worker_train_ulysses(rank, world, seed, steps):
    return [_worker_train(rank, world, seed, layout, steps, mode="ulysses")
            for layout in ("contiguous", "zigzag")]


def test_sp_training_equals_single_process_ulysses():
    # head-sharded: each rank attends the whole sequence with 2 of the 4 query heads (1 of the
    # 2 key/value heads), numbered as in one process; packed documents and padding in the last
    # step, as above
    res = run_distributed(_worker_train_ulysses, 2, 4321, 3, timeout=240)
    assert res[0] == res[1], "exact: both ranks of the group see the same global loss"


# ------------------------------------------------------------------ examples/finetune.py
PATTERN_YAML = "segment_lengths: [16, 64, 128]\ndilation_rates: [1, 2, 4]\n"
TIMEOUT = 240
HIDDEN = 64  # finetune.py's built-in model (and build_default_model's)
# The runs below give finetune.py's per-step losses of the same function through other sums
# (the ring's shards, chunked loss, tiled MLP): 96 tokens a step (--seq-len 97), rows of <= 97
# keys, HIDDEN features (conftest.model_tol). Its AdamW at the default lr 1e-4 turns a float32
# gradient difference dg into a weight difference of at most ~2·lr where dg flips a sign: a
# loss change of ~(2·lr)**2 times the curvature, far below this.
LOSS_RTOL = model_tol(96, 97, HIDDEN)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid):
    """Pids of every process below ``pid`` (torchrun starts each worker in a session of its own,
    so a process-group signal would miss them)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _run(cmd, out_dir):
    """Run ``cmd``; on a hang, the launcher and every worker print their Python stacks
    (faulthandler on SIGABRT) and the test fails with them instead of a bare timeout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        tree = _descendants(proc.pid)
        for pid in tree + [proc.pid]:  # workers first: their stacks are the interesting ones
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(5)
        for pid in tree + [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} hung for {TIMEOUT} s; stacks and output:\n"
                    f"{stdout[-3000:]}\n{stderr[-12000:]}")
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed:\n{stdout[-3000:]}\n"
                                  f"{stderr[-5000:]}")
    _run.last_stderr = stderr
    return _losses(out_dir)


def _losses(out_dir):
    """The per-step losses of ``out_dir/train_log.jsonl``."""
    log = {}
    for line in (out_dir / "train_log.jsonl").read_text().splitlines():
        rec = json.loads(line)
        log[rec["step"]] = rec["loss"]  # a resumed run appends; the last record of a step wins
    return [log[k] for k in sorted(log)]


def _run_here(args, out_dir):
    """A one-process run of examples/finetune.py (``args`` as ``_args`` gives them, the script
    first): its main() in this process, as ``_main_exits`` runs it (``helpers.run_finetune_here``:
    the run costs its steps, not a process that spends its time importing). Its per-step
    losses, as ``_run``'s."""
    assert args[0] == "examples/finetune.py", args
    run_finetune_here(_finetune_module().main, args[1:])
    return _losses(out_dir)


def _args(tmp_path, out, steps, *extra):
    return ["examples/finetune.py", "--seq-len", "97", "--max-steps", str(steps), "--save-every",
            "2", "--output-dir", str(out), "--pattern", str(tmp_path / "p.yaml"), "--cpu", *extra]


def _torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(n)]


def _accelerate():
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "configs/accelerate/sp2_cpu.yaml"), "--main_process_port", str(_free_port())]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The losses of 4 steps of examples/finetune.py in one process: what the sequence-parallel
    and chunked-loss runs below must reproduce (run once for both tests)."""
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "p.yaml").write_text(PATTERN_YAML)
    return _run_here(_args(tmp, tmp / "one", 4), tmp / "one")


def test_finetune_sp2_matches_one_process_and_resumes_exactly(tmp_path, one_process):
    (tmp_path / "p.yaml").write_text(PATTERN_YAML)
    one = one_process
    full = _run([*_torchrun(2), *_args(tmp_path, tmp_path / "sp2", 4)], tmp_path / "sp2")
    # close: same model, data and gradients; the ring sums in another order (LOSS_RTOL)
    assert full == pytest.approx(one, rel=LOSS_RTOL), (full, one)
    # killed after step 2: what such a run leaves is this run's checkpoint of step 2 (saved
    # mid-run, as a killed run's last one is) and its log of steps 1-2. Resumed from there under
    # accelerate launch: steps 3-4 exactly those of the uninterrupted run
    part = tmp_path / "resumed"
    shutil.copytree(tmp_path / "sp2" / "checkpoints" / "step_2", part / "checkpoints" / "step_2")
    assert (part / "checkpoints" / "step_2" / "optimizer.bin").exists()
    log = (tmp_path / "sp2" / "train_log.jsonl").read_text().splitlines()
    (part / "train_log.jsonl").write_text("\n".join(log[:2]) + "\n")
    resumed = _run([*_accelerate(), *_args(tmp_path, part, 4, "--resume", "latest")], part)
    assert len(resumed) == 4 and resumed[2:] == full[2:], \
        f"exact: resumed trajectory {resumed} != uninterrupted {full}"
    # said once (rank 0), and the progress bar shows no tokens/s before a step has been timed
    assert _run.last_stderr.count("resumed from") == 1, _run.last_stderr[-3000:]
    assert "tok_s=0" not in _run.last_stderr
    # nothing written is lost; the final model keeps the pattern
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step_2", "step_4"]
    cfg = json.loads((part / "final" / "config.json").read_text())
    assert cfg["hilbert_attn"]["segment_lengths"] == [16, 64, 128], cfg.get("hilbert_attn")
    # the built-in byte tokenizer is saved too: final/ evaluates as it is
    from transformers import AutoTokenizer

    from hf_hilbert_attn.tools.evaluation import EvalConfig, run_eval

    tok = AutoTokenizer.from_pretrained(part / "final")
    assert tok("héllo\n")["input_ids"] == list("héllo\n".encode()) and tok.eos_token_id == 256
    rows = run_eval(EvalConfig(model=str(part / "final"), patterns=("dense",), lengths=(64,),
                               tasks=("perplexity",), ppl_tokens=64, out_dir=str(tmp_path / "ev"),
                               plots=False, progress=False, device="cpu"))["rows"]
    # sdpa = dense pattern: 63 tokens' NLL through rows of <= 64 keys; exp: times |log ppl|
    rel = model_tol(63, 64, HIDDEN) * max(1.0, math.log(rows[0]["value"]))
    assert rows[0]["value"] == pytest.approx(rows[1]["value"], rel=rel)


def test_finetune_chunked_loss_matches_model_loss(tmp_path, one_process):
    """--loss-chunk (CE from hidden states, chunk by chunk) gives the model's own loss, alone
    and under sequence parallelism (each shard divides by the whole sequence's label count)."""
    (tmp_path / "p.yaml").write_text(PATTERN_YAML)
    one = one_process
    chunked = _run_here(_args(tmp_path, tmp_path / "c1", 4, "--loss-chunk", "13"),
                        tmp_path / "c1")
    assert chunked == pytest.approx(one, rel=LOSS_RTOL), (chunked, one)
    sp = _run([*_torchrun(2), *_args(tmp_path, tmp_path / "c2", 4, "--loss-chunk", "13",
                                     "--layout", "zigzag", "--gradient-checkpointing")],
              tmp_path / "c2")
    assert sp == pytest.approx(one, rel=LOSS_RTOL), (sp, one)


def test_finetune_rejects_bad_arguments(tmp_path, capsys):
    # a real process once (the exit status a shell sees), then main() in this process: the same
    # SystemExit(2) and stderr, without a process that spends its time importing
    proc = subprocess.run([sys.executable, "examples/finetune.py", "--loss-chunk", "-1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--loss-chunk must be >= 0" in proc.stderr, proc.stderr
    code, err = _main_exits(capsys, "--model", "x", "--model-preset", "1b")
    assert code == 2 and "exclude each other" in err, err


def _main_exits(capsys, *argv):
    """(exit status, stderr) of examples/finetune.py's main() on arguments it refuses."""
    ft = _finetune_module()
    with pytest.raises(SystemExit) as e:
        ft.main(list(argv))
    return e.value.code, capsys.readouterr().err


def _finetune_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_example", ROOT / "examples/finetune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finetune_txt_file_is_one_document(tmp_path):
    texts = ["ACT I.\nSCENE I. Elsinore.\n\nWho's there?\n", "line one\nline two"]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t)
    (tmp_path / "blank.txt").write_text("\n")
    ft = _finetune_module()
    assert ft.load_texts(tmp_path, "text") == texts  # name order, newlines kept
    assert ft.load_texts(tmp_path / "1.txt", "text") == [texts[1]]


def test_finetune_txt_directory_tokenizer_and_stats(tmp_path):
    """A model directory with its tokenizer, a directory of .txt documents: final/ loads with its
    tokenizer, train_stats.json has the timings, and sdpa and the dense pattern (same data
    order, seed and lr) train to the same losses."""
    from transformers import AutoTokenizer

    from hf_hilbert_attn.tools.evaluation.corpus import (build_char_tokenizer, build_default_model,
                                                   builtin_corpus)

    tok = build_char_tokenizer()
    build_default_model(tok, seed=3).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "data").mkdir()
    for i, doc in enumerate(builtin_corpus(6000, seed=1)):
        (tmp_path / "data" / f"{i:03d}.txt").write_text(doc.replace(". ", ".\n"))
    (tmp_path / "dense.yaml").write_text("segment_lengths: [1073741824]\ndilation_rates: [1]\n")
    losses = {}
    dense = ["--pattern", str(tmp_path / "dense.yaml")]
    for impl, extra in (("sdpa", []), ("hilbert_dilated", dense)):
        out = tmp_path / impl
        losses[impl] = _run_here(["examples/finetune.py", "--model", str(tmp_path / "model"),
                                  "--data", str(tmp_path / "data"), "--seq-len", "64",
                                  "--max-steps", "3", "--save-every", "0", "--lr", "1e-4",
                                  "--attn-implementation", impl, "--output-dir", str(out),
                                  "--cpu", *extra], out)
        final = out / "final"
        loaded = AutoTokenizer.from_pretrained(final)
        assert loaded("Hello 12345.")["input_ids"] == tok("Hello 12345.")["input_ids"]
        cfg = json.loads((final / "config.json").read_text())
        assert ("hilbert_attn" in cfg) == (impl == "hilbert_dilated"), cfg.get("hilbert_attn")
        if impl == "hilbert_dilated":  # final/ is a model the eval takes as it is
            from hf_hilbert_attn.tools.evaluation import EvalConfig, run_eval

            rows = run_eval(EvalConfig(model=str(final), tasks=("perplexity",), lengths=(64,),
                                       ppl_tokens=128, corpus=(str(tmp_path / "data" / "000.txt"),),
                                       out_dir=str(tmp_path / "eval"), plots=False,
                                       progress=False))["rows"]
            assert [r["method"] for r in rows] == ["sdpa", "hilbert_dilated:default"]
            assert all(math.isfinite(r["value"]) for r in rows)
        stats = json.loads((out / "train_stats.json").read_text())
        assert stats["steps"] == 3 and stats["timing_excludes_first_step"]
        assert stats["seconds_per_step"] > 0 and stats["tokens_per_s"] > 0
        assert stats["tokens_per_step"] == 64 and stats["attn_implementation"] == impl
        assert stats["final_loss"] == losses[impl][-1]
        assert stats["mixed_precision"] == "no"  # CPU
    # 63 tokens a step, rows of <= 64 keys (LOSS_RTOL's rule); lr 1e-4, as LOSS_RTOL assumes
    assert losses["hilbert_dilated"] == pytest.approx(losses["sdpa"], rel=model_tol(63, 64, HIDDEN))


def test_finetune_sdpa_refuses_sequence_parallel(capsys):
    code, err = _main_exits(capsys, "--attn-implementation", "sdpa", "--sp-size", "2")
    assert code == 2 and "cannot shard a sequence" in err, err


def test_finetune_arguments_inline_pattern_aliases_and_defaults():
    from hf_hilbert_attn import DilatedPattern

    ft = _finetune_module()
    args = ft.parse_args(["--pattern", "8,16:1,4:sinks=1", "--text-column", "body"])
    assert args.pattern == DilatedPattern([8, 16], [1, 4], sink_tokens=1)  # inline, as eval
    assert args.text_field == "body"  # the old flag name still works
    assert ft.parse_args(["--text-field", "t"]).text_field == "t"
    assert ft.parse_args(["--pattern", "longnet_lm"]).pattern.segment_lengths[-1] == 32768
    assert ft.parse_args(["--attn", "sdpa"]).attn_implementation == "sdpa"
    assert ft.parse_args([]).lr == 1e-4


@pytest.mark.parametrize("extra,message", [
    (["--model", "/nonexistent"], "--model /nonexistent: path not found"),
    (["--data", "/no/such/dir"], "--data /no/such/dir: path not found"),
    (["--pattern", "8,16:1,32"], r"dilation_rates\[1\] must be <= segment_lengths\[1\]"),
    # one process (`accelerate launch --num_processes 2` without --multi_gpu): how to launch
    (["--sp-size", "2"], r"--sp-size 2 must divide the number of processes \(1\); start it "
                         r"with `torchrun --nproc_per_node N` or `accelerate launch --multi_gpu"),
])
def test_finetune_bad_inputs_are_one_line(extra, message, capsys):
    import re

    code, err = _main_exits(capsys, *extra)  # an exception other than SystemExit would escape
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if "finetune.py: error:" in ln]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert "Traceback" not in err


def test_finetune_bad_sp_size_under_torchrun_is_one_line_from_rank_0(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([*_torchrun(2), "examples/finetune.py", "--sp-size", "3",
                           "--output-dir", str(tmp_path / "x")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0
    # our one line, once; what follows is torchrun's own summary of the failed workers
    assert proc.stderr.count("finetune.py: error: --sp-size 3 must divide the number of "
                             "processes (2)") == 1, proc.stderr
    assert 'File "' + str(ROOT / "examples" / "finetune.py") not in proc.stderr


def test_finetune_memory_options_keep_the_losses(tmp_path, capsys):
    # --tiled-mlp / --offload-checkpoints (hf_hilbert_attn.long_context) change where
    # activations live, not what is computed: the same per-step losses as the plain run
    (tmp_path / "p.yaml").write_text("segment_lengths: [16, 32]\ndilation_rates: [1, 2]\n")
    base = _args(tmp_path, tmp_path / "plain", 3, "--save-every", "0", "--gradient-checkpointing",
                 "--loss-chunk", "40")
    plain = _run_here(base, tmp_path / "plain")
    opts = _args(tmp_path, tmp_path / "opts", 3, "--save-every", "0", "--gradient-checkpointing",
                 "--loss-chunk", "40", "--tiled-mlp", "30", "--offload-checkpoints")
    tiled = _run_here(opts, tmp_path / "opts")
    assert len(plain) == 3 and tiled == pytest.approx(plain, rel=LOSS_RTOL)
    code, err = _main_exits(capsys, "--offload-checkpoints")
    assert code == 2 and "needs --gradient-checkpointing" in err, err
