"""``python -m hf_hilbert_attn.tools.cli ...`` command lines as processes forked from this one
after ``import hf_hilbert_attn`` (torch, transformers: seconds that every command spends before
it parses its arguments), for the tests of the exit status a shell sees (``test_cli.py``).

``python tests/_cli_forks.py RUNS.json``: ``RUNS.json`` is a list of ``{"argv": [...], "cwd":
DIR, "out": PREFIX}``; every command runs at once, each in a child forked from this process,
which runs the module as ``python -m`` does (``runpy``, ``sys.argv[0]`` the module's file,
``sys.path[0]`` its working directory) with its stdout and stderr in ``PREFIX.stdout`` and
``PREFIX.stderr``, and leaves as a script does: the interpreter itself turns the
``SystemExit`` or the uncaught exception into the exit status and the message or traceback on
stderr, then tears down. Prints the children's exit statuses (a JSON list, in order).
"""

import json
import os
import runpy
import sys

import hf_hilbert_attn  # noqa: F401  (the imports every command makes first)


def _child(run) -> None:
    os.chdir(run["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(f"{run['out']}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["-m", *run["argv"]]  # runpy puts the module's file first
    sys.path[0] = os.getcwd()  # as `python -m` (this script's folder otherwise)
    runpy.run_module("hf_hilbert_attn.tools.cli", run_name="__main__", alter_sys=True)


def main(spec: str) -> None:
    with open(spec) as f:
        runs = json.load(f)
    pids = []
    for run in runs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(run)  # a SystemExit or an exception leaves through the interpreter: no return
            sys.exit(0)  # the module ran to its end without one
        pids.append(pid)
    print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]))


if __name__ == "__main__":
    main(sys.argv[1])
