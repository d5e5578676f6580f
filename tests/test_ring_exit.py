"""The ring leaves nothing alive at exit (issue 27, item 9).

A gloo job that used ``ring_attention`` aborted at exit in about half its runs ("terminate called
without an active exception", exit -6): the autograd context of the ring's output held the
process group, so a script that keeps its output to the end kept the group, its gloo threads and
sockets alive past ``destroy_process_group()``. The ring now holds the group weakly
(``ring.comm.weak_group``).

* ``_ring_exit_job.py`` once under ``torchrun``, as users launch it, and ``FORKED_RUNS`` times
  as two ranks forked from one process that imported once (a rank then costs a fork, not an
  interpreter and the imports; each still exits through interpreter teardown): every rank of
  every run must exit 0. A 50 % abort survives six runs with probability 0.5**6 = 1.6 %; the job
  also exits 3 on the cause itself (group still referenced after ``destroy_process_group()``),
  every run (also when forked).
* In-process: after the group is destroyed, the graph of a ring output no longer holds it, and a
  backward through it raises a clear error instead of posting on a dead group.
"""

import concurrent.futures
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from _dist import run_distributed
from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn.ring import ring_attention
from hf_hilbert_attn.sharding import shard_positions

pytestmark = pytest.mark.multiprocess

FORKED_RUNS = 5  # + the torchrun run: six, as when each run was a torchrun job
JOB = os.path.join(os.path.dirname(__file__), "_ring_exit_job.py")


def _torchrun(*job_args) -> subprocess.CompletedProcess:
    # --standalone: a free port per job, so parallel jobs (and test runs) never collide
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", JOB, *job_args]
    return _run(cmd)


def _run(cmd) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def test_ring_job_exits_cleanly_under_torchrun_and_forked():
    # the torchrun job and the forked runs side by side
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        torchrun = pool.submit(_torchrun)
        forked = pool.submit(_run, [sys.executable, JOB, "--forked-runs", str(FORKED_RUNS)])
        runs = [torchrun.result(), forked.result()]
    failed = [(what, r.returncode, (r.stdout + r.stderr)[-1500:])
              for what, r in zip(("torchrun", f"{FORKED_RUNS} forked runs"), runs)
              if r.returncode != 0]
    assert not failed, "\n".join(f"--- {what}: exit {rc}\n{tail}" for what, rc, tail in failed)


def _destroyed_group_is_released(rank, world):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    pat = DilatedPattern([8, 32], [1, 4])
    g = torch.Generator().manual_seed(0)
    s = 32
    pos = shard_positions(s, world, "zigzag")[rank]
    q, k, v = (torch.randn(1, h, s, 8, dtype=torch.float64, generator=g)[:, :, pos]
               .requires_grad_() for h in (2, 1, 1))
    out = ring_attention(q, k, v, pat, group=group, q_positions=pos, k_positions=pos)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    released = ref() is None  # `out` (and its graph) is alive here
    try:
        out.sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    return released, error


def test_ring_graph_releases_a_destroyed_group():
    for released, error in run_distributed(_destroyed_group_is_released, 2, timeout=120):
        assert released, "the ring output's autograd graph keeps its process group alive"
        assert error is not None and "process group of this 2-rank ring was destroyed" in error


def _sp_group_is_released(rank, world):
    import torch.distributed as dist

    from hf_hilbert_attn.integrations.accelerate import sequence_parallel_topology

    topo = sequence_parallel_topology(None, world)
    same = sequence_parallel_topology(None, world).group is topo.group  # cached while it lives
    x = torch.ones(2)
    dist.all_reduce(x, group=topo.group)
    ref = weakref.ref(topo.group)
    dist.destroy_process_group(topo.group)
    del topo
    gc.collect()
    released = ref() is None
    again = sequence_parallel_topology(None, world)  # a new group, which works
    y = torch.ones(2)
    dist.all_reduce(y, group=again.group)
    return same, released, y.tolist()


def test_sequence_parallel_group_is_not_kept_past_its_destruction():
    """The topology's cache holds its SP groups weakly: a group kept past
    ``destroy_process_group()`` runs its gloo threads into interpreter teardown (the exit hang of
    a sequence-parallel fine-tune, CI 2026-11-27)."""
    for same, released, y in run_distributed(_sp_group_is_released, 2, timeout=120):
        assert same, "sequence_parallel_topology made a second group for the same split"
        assert released, "the SP-group cache keeps a destroyed group alive"
        assert y == [2.0, 2.0]
