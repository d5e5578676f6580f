"""The ``hf-hilbert-attn`` console command: each subcommand prints what it claims; bad arguments
exit non-zero with a message naming the bad value."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn.tools.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fails(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_env_reports_versions_and_kernels(capsys):
    import torch
    import transformers

    rc, out, _ = _run(capsys, "env")
    assert rc == 0
    assert f"torch         {torch.__version__}" in out
    assert f"transformers  {transformers.__version__}" in out
    for name in ("accelerate", "triton", "cuda device", "triton kernels",
                 "'hilbert_dilated' registered"):
        assert name in out
    if not torch.cuda.is_available():
        assert "cuda device   none" in out
        assert "no CUDA device" in out or "not usable" in out


def test_show_pattern_ascii_counts_and_png(capsys, tmp_path):
    png = tmp_path / "mask.png"
    rc, out, _ = _run(capsys, "show-pattern", "8,16:1,4", "--length", "24", "--heads", "4",
                      "--png", str(png))
    assert rc == 0
    p = DilatedPattern([8, 16], [1, 4])
    pairs = p.count_pairs(24, 4)
    assert f"allowed pairs per head   {pairs[0]} (same for all 4 heads)" in out
    assert "dense causal pairs per head 300" in out
    assert f"density                  {sum(pairs) / (4 * 300):.4%}" in out
    # The ASCII rows are the mask of head 0: '#' exactly where build_mask allows.
    import torch

    mask = p.build_mask(1, torch.arange(24), torch.arange(24))[0, 0]
    rows = [line for line in out.splitlines() if line[:2].strip().isdigit()][:24]
    assert len(rows) == 24
    for q, line in enumerate(rows):
        cells = line[3:3 + 24]
        assert [c == "#" for c in cells] == mask[q].tolist(), line
        assert line.rstrip().endswith(str(int(mask[q].sum())))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_show_pattern_long_length_skips_ascii(capsys):
    rc, out, _ = _run(capsys, "show-pattern", str(REPO / "hf_hilbert_attn" / "patterns" / "longnet_lm.yaml"),
                      "--length", "64k", "--heads", "2")
    assert rc == 0
    assert "no ASCII picture above 64 tokens" in out
    assert "attention FLOPs vs dense 0.04" in out  # ~5% of the causal pairs at 64K


@pytest.mark.parametrize("argv,message", [
    (["show-pattern", "missing.yaml", "--length", "8"], "pattern file not found: missing.yaml"),
    (["show-pattern", "8,16:1,32", "--length", "8"],
     r"dilation_rates\[1\] must be <= segment_lengths\[1\] = 16, got 32"),
    (["show-pattern", "8:2", "--length", "8"], "dilation_rates must contain a 1"),
    (["show-pattern", "tiny", "--length", "-4"], "--length must be >= 1, got -4"),
    (["show-pattern", "tiny", "--length", "abc"], "expected a length like 4096"),
    (["show-pattern", "tiny", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["eval", "--lengths", "1"], "a context length must be >= 2, got 1"),
    (["eval", "--depths", "1.5"], r"a needle depth must be in \[0, 1\], got 1.5"),
    (["eval", "--pattern", "nope"], "unknown pattern 'nope'"),
    (["eval", "/no/such/model"], "model path not found: /no/such/model"),
    # a missing model is a usage error (exit 2) for every command that takes one
    (["calibrate", "/no/such/model"], "model directory not found: /no/such/model"),
    (["quality", "--model", "/no/such/model"], "model directory not found: /no/such/model"),
    (["calibrate", "/no/such/model", "--budget", "0"],
     r"--budget must be in \(0, 1\], got 0.0 \(0 makes no head dense: nothing to calibrate\)"),
    (["eval", "--corpus", "/no/such.txt"], "corpus file or directory not found: /no/such.txt"),
    (["eval", "--lengths", "64", "--stride", "64"], "stride must be < every length"),
    (["bench", "model", "--preset", "huge"], "invalid choice: 'huge'"),
    (["bench", "model"], "choose what to run: --preset 135m: .*; --preset 1b: .*; --preset tiny: "),
    (["bench", "model", "--preset", "tiny", "--device", "cuda:x"], "expected auto, cpu, cuda"),
    (["bench", "model", "--lengths", "-8"], "a sequence length must be >= 2, got -8"),
    (["bench"], "required: WHAT"),
    ([], "required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_exit_2_with_message(capsys, argv, message):
    import re

    err = _fails(capsys, *argv)
    assert re.search(message, err), err
    assert "usage: hf-hilbert-attn" in err


def test_eval_command_runs_builtin(capsys, tmp_path):
    rc, out, _ = _run(capsys, "eval", "--pattern", "tiny", "--lengths", "64", "--ppl-tokens",
                      "200", "--passkey-lengths", "128", "--depths", "0.5", "--trials", "1",
                      "--max-new-tokens", "4", "--out-dir", str(tmp_path), "--no-progress")
    assert rc == 0
    assert "## Perplexity by context length" in out and "| sdpa |" in out
    for name in ("results.csv", "results.md", "perplexity.png", "passkey_heatmap.png"):
        assert (tmp_path / name).is_file()
        assert str(tmp_path / name) in out


def _cli_processes(tmp_path, *runs):
    """``python -m hf_hilbert_attn.tools.cli ARGV`` in ``CWD`` for each ``(ARGV, CWD)`` of
    ``runs``, as processes of their own (the exit status, stdout and stderr a shell sees), forked
    from one that made the imports every command makes first (tests/_cli_forks.py: seconds a
    command less). Returns (returncode, stdout, stderr) of each, in order."""
    import json
    from types import SimpleNamespace

    spec = [{"argv": list(argv), "cwd": str(cwd), "out": str(tmp_path / f"cli{i}")}
            for i, (argv, cwd) in enumerate(runs)]
    (tmp_path / "cli_runs.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "_cli_forks.py"),
                           str(tmp_path / "cli_runs.json")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.splitlines()[-1])
    return [SimpleNamespace(returncode=code, stdout=Path(f"{r['out']}.stdout").read_text(),
                            stderr=Path(f"{r['out']}.stderr").read_text())
            for code, r in zip(codes, spec)]


def test_console_module_exit_code(tmp_path):
    # A real process: the exit status a shell sees.
    bad, ok = _cli_processes(tmp_path, (["show-pattern", "tiny", "--length", "0"], REPO),
                             (["show-pattern", "tiny", "--length", "8"], REPO))
    assert bad.returncode == 2 and "--length must be >= 1, got 0" in bad.stderr
    assert ok.returncode == 0 and "allowed pairs per head   36\n" in ok.stdout


# ----------------------------------------------------------------------------- one-line errors
def test_version(capsys):
    from hf_hilbert_attn import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-hilbert-attn {__version__}"


def test_show_pattern_without_arguments_shows_the_default(capsys):
    from hf_hilbert_attn.patterns import default

    rc, out, _ = _run(capsys, "show-pattern", "--heads", "1")
    assert rc == 0
    assert f"pattern   {default()}" in out
    assert f"length    {default().max_segment} tokens" in out


def _input_error(capsys, *argv):
    """An input error found after parsing: SystemExit with one line 'PROG: error: ...'."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    msg = e.value.code
    assert isinstance(msg, str) and "\n" not in msg, msg
    return msg


def test_bad_inputs_are_one_line_errors(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    msg = _input_error(capsys, "eval", "--corpus", str(tmp_path / "empty.txt"), "--tasks",
                       "perplexity", "--lengths", "64", "--no-progress", "--out-dir",
                       str(tmp_path / "o"))
    assert msg == f"hf-hilbert-attn eval: error: corpus file is empty: {tmp_path / 'empty.txt'}"
    (tmp_path / "short.txt").write_text("hello")
    msg = _input_error(capsys, "eval", "--corpus", str(tmp_path / "short.txt"), "--tasks",
                       "perplexity", "--lengths", "64", "--no-progress", "--out-dir",
                       str(tmp_path / "o"))
    assert msg.startswith("hf-hilbert-attn eval: error: the corpus has 6 tokens, fewer than "
                          "the longest context length 64"), msg
    assert not (tmp_path / "o" / "results.md").exists()  # no table of a 6-token corpus


def test_missing_tool_package_names_the_extra(capsys, tmp_path, monkeypatch):
    # matplotlib draws --png; without it (None in sys.modules: import fails) one line says
    # which extra installs it, and nothing is drawn
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "mask.png"
    msg = _input_error(capsys, "show-pattern", "tiny", "--length", "8", "--png", str(png))
    assert msg == ('hf-hilbert-attn show-pattern: error: matplotlib is not installed: '
                   'the tools extra, pip install -e ".[tools]" in a checkout or a built wheel '
                   'with [tools]'), msg
    assert not png.exists()


def test_eval_without_matplotlib_stops_before_any_model(capsys, tmp_path, monkeypatch):
    # the plots need it: one line at once, not after every cell has run (--no-plots runs)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    msg = _input_error(capsys, "eval", "--out-dir", str(tmp_path))
    assert msg.startswith("hf-hilbert-attn eval: error: matplotlib is not installed"), msg
    assert not (tmp_path / "results.csv").exists()


def test_library_import_loads_no_tool():
    code = ("import sys, hf_hilbert_attn; "
            "print(sorted(m for m in sys.modules if m.startswith('hf_hilbert_attn.tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_bad_yaml_pattern_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("segment_lengths: [1, 2\ndilation_rates: [1]\n")
    for argv in (["show-pattern", str(bad), "--length", "8"], ["eval", "--pattern", str(bad)]):
        err = _fails(capsys, *argv)
        assert f"error: pattern file {bad} is not valid YAML: expected ',' or ']'" in err, err
        assert "Traceback" not in err and "yaml.parser" not in err
    bad.write_text("segment_lengths: [8]\n")
    err = _fails(capsys, "show-pattern", str(bad), "--length", "8")
    assert f"error: pattern file {bad}: " in err and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_gpu_commands_refuse_on_cpu(capsys):
    err = _fails(capsys, "eval", "--device", "cuda")
    assert "--device cuda: " in err and "use --device cpu" in err
    msg = _input_error(capsys, "bench", "model", "--preset", "1b")
    assert msg.startswith("hf-hilbert-attn bench model: error: --preset 1b needs a CUDA GPU")
    assert "--preset tiny" in msg
    msg = _input_error(capsys, "bench", "attention")
    assert msg.startswith("hf-hilbert-attn bench attention: error: this benchmark times GPU "
                          "kernels"), msg
    assert "--device cpu --ours-backend torch" in msg
    msg = _input_error(capsys, "bench", "attention", "--device", "cuda")
    assert "torch sees no CUDA device" in msg


def test_input_error_exit_status_and_debug(tmp_path):
    # A real process: one line on stderr, exit status 1; --debug keeps the traceback.
    (tmp_path / "empty.txt").write_text("")
    argv = ["eval", "--corpus", str(tmp_path / "empty.txt"), "--tasks", "perplexity", "--lengths",
            "64", "--out-dir", str(tmp_path / "o")]
    bad, dbg = _cli_processes(tmp_path, (argv, tmp_path), (["--debug"] + argv, tmp_path))
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("hf-hilbert-attn eval: error: "
                                                          "corpus file is empty")
    assert "Traceback" not in bad.stderr
    assert dbg.returncode == 1 and "Traceback" in dbg.stderr and "InputError" in dbg.stderr


# ----------------------------------------------------------------------------- pictures
def _white_border(path, px=3):
    """Nothing (title, legend, axis label) runs off the picture: its outer pixels are white."""
    import matplotlib.image

    img = matplotlib.image.imread(str(path))[..., :3]
    edges = [img[:px], img[-px:], img[:, :px], img[:, -px:]]
    return all(float(e.min()) > 0.99 for e in edges)


@pytest.mark.parametrize("argv", [["8,32:1,4", "--length", "32", "--heads", "2"],
                                  ["longnet_lm", "--length", "4k", "--heads", "2"]])
def test_show_pattern_png_fits_and_names_the_file(capsys, tmp_path, argv):
    rc, out, _ = _run(capsys, "show-pattern", *argv, "--png", str(tmp_path / "noext"))
    assert rc == 0
    assert f"wrote {tmp_path / 'noext.png'}" in out  # the file it really wrote
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert _white_border(tmp_path / "noext.png")


# ----------------------------------------------------------------------------- issue 37
def test_show_pattern_default_length_is_one_a_picture_can_show(capsys, monkeypatch, tmp_path):
    # `show-pattern dense --png F` drew 2^30 tokens (OOM-killed): without --length the picture
    # is at most PNG_DEFAULT_LENGTH tokens and the counts at most COUNT_DEFAULT_LENGTH, and the
    # output says so; a pattern whose longest segment fits keeps it
    from hf_hilbert_attn.tools import cli, visualize

    drawn = []
    monkeypatch.setattr(visualize, "save_mask_png",
                        lambda pattern, length, path, **k: drawn.append(length) or Path(path))
    rc, out, _ = _run(capsys, "show-pattern", "dense", "--png", str(tmp_path / "d.png"))
    assert rc == 0 and drawn == [cli.PNG_DEFAULT_LENGTH] == [4096]
    assert ("length    4096 tokens, 1 head(s), causal  (the default: the pattern's longest "
            "segment, 1073741824, capped at 4096 for --png; --length N for another)") in out
    assert f"wrote {tmp_path / 'd.png'} (the mask at 4096 tokens)" in out
    rc, out, _ = _run(capsys, "show-pattern", "dense")
    assert rc == 0 and "length    65536 tokens" in out and "capped at 65536;" in out
    rc, out, _ = _run(capsys, "show-pattern", "tiny", "--png", str(tmp_path / "t.png"))
    assert rc == 0 and drawn[-1] == 256 and "length    256 tokens, 1 head(s), causal\n" in out
    rc, out, _ = _run(capsys, "show-pattern", "dense", "--length", "8k", "--png",
                      str(tmp_path / "e.png"))
    assert rc == 0 and drawn[-1] == 8192 and "capped" not in out  # --length is the user's


def test_progress_lines_at_a_bounded_rate(monkeypatch):
    import io
    import time

    from hf_hilbert_attn.tools.progress import LineProgress, progress_bar, stage

    log = io.StringIO()  # not a terminal
    with progress_bar(total=1000, desc="stage", unit="steps", stream=log) as bar:
        assert isinstance(bar, LineProgress)
        for _ in range(1000):
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert lines[0] == "stage: started, 0/1000 steps"
    assert lines[-1].startswith("stage: done, 1000/1000 steps in ")
    assert len(lines) == 2  # 1000 quick steps within the 10 s interval: no line between
    # one step longer than the interval: the timer says where it is
    log = io.StringIO()
    with LineProgress(total=4, desc="slow", unit="prompts", stream=log, interval=0.2) as bar:
        bar.update(1)
        bar.set_postfix_str("running b")
        time.sleep(1.3)
    lines = log.getvalue().splitlines()
    beats = [ln for ln in lines if ln.startswith("slow: 1/4 prompts (running b), ")]
    assert 2 <= len(beats) <= 7, lines  # at most one per 0.2 s
    assert beats[0].endswith(" left")
    # --no-progress, or a terminal: no lines; stage() writes only off a terminal
    quiet = io.StringIO()
    with progress_bar(total=3, desc="x", disable=True, stream=quiet) as bar:
        bar.update(3)
    stage("a stage", stream=quiet, enabled=False)
    assert quiet.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    stage("a stage", stream=tty)
    assert tty.getvalue() == ""
    stage("a stage", stream=quiet)
    assert quiet.getvalue() == "a stage\n"
    pytest.importorskip("tqdm")
    from tqdm.auto import tqdm

    bar = progress_bar(total=3, desc="x", stream=tty)
    assert isinstance(bar, tqdm)
    bar.close()
    assert not isinstance(progress_bar(total=3, stream=tty, terminal_bar=False), tqdm)


def test_progress_time_left_weighs_steps_by_their_cost(monkeypatch):
    """A benchmark's steps grow with their length squared: weighted, the time left after two
    cheap steps counts the expensive one to come (an average step would say seconds)."""
    import io
    import types

    from hf_hilbert_attn.tools import progress

    clock = [100.0]  # (this module's clock only)
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setenv("HF_HILBERT_PROGRESS_SECONDS", "0")  # a line per step
    log = io.StringIO()
    with progress.progress_bar(total=3, desc="b", unit="steps", stream=log,
                               weights=[1, 1, 100]) as bar:
        for t in (2.0, 4.0):  # each cheap step took 2 s: 2 s per unit of cost
            clock[0] = 100.0 + t
            bar.update(1)
    lines = log.getvalue().splitlines()
    assert lines[1] == "b: 1/3 steps, 2s elapsed, ~3m22s left", lines  # 2 + 200 s to come
    assert lines[2] == "b: 2/3 steps, 4s elapsed, ~3m20s left", lines
    with pytest.raises(ValueError, match="weights must be 3 positive numbers"):
        progress.LineProgress(total=3, stream=io.StringIO(), interval=0, weights=[1, 2])


def test_bench_cpu_prints_progress_lines_when_stderr_is_a_log(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HILBERT_PROGRESS_SECONDS", "0")
    rc = main(["bench", "cpu", "--lengths", "128", "256", "--shapes", "2/1x16", "--patterns",
               "tiny", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "bench cpu (attention): started, 0/2 steps"
    assert err[1].startswith("bench cpu (attention): 1/2 steps (running 2/1x16 at 128), ")
    assert err[-1].startswith("bench cpu (attention): done, 2/2 steps in ")
