"""A small gloo ring-attention job for ``torchrun``, written as a user's script would be.

``python -m torch.distributed.run --nproc_per_node 2 tests/_ring_exit_job.py [--op ring|dilated]
[--no-destroy] [--release-outputs]`` (``test_ring_exit.py`` runs it): each rank runs a float64
ring forward and backward on its zigzag shard, checks its rows against the single-process op,
keeps its output (and so the autograd graph) alive to the end, destroys the process group and
exits.

``python tests/_ring_exit_job.py --forked-runs N [job options]`` runs the same job N times at
once, each as two ranks forked from this process after its imports (a rank costs a fork, not an
interpreter and the imports), and each rank still exits as a script does, through interpreter
teardown.
Exits 1 if any rank of any run exited non-zero (or died of a signal), saying which.

Issue 27: this exited with -6 ("terminate called without an active exception") in about half
the runs, because the ring's autograd context held the process group, so the group, its gloo
worker threads and its sockets outlived ``destroy_process_group()`` into interpreter teardown.
Exit status 3 here says that deterministically: the group is still referenced after
``destroy_process_group()``, or more native threads are alive than before it was made.
"""

import argparse
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

from conftest import attention_tol  # tests/ is the script's directory
from hf_hilbert_attn import DilatedPattern, dilated_attention
from hf_hilbert_attn.ring import ring_attention
from hf_hilbert_attn.sharding import shard_positions

_KEEP = []  # outputs held to exit, as a script's module-level results are


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=["ring", "dilated"], default="ring")
    ap.add_argument("--no-destroy", action="store_true")
    ap.add_argument("--release-outputs", action="store_true",
                    help="drop the outputs before destroying the group")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.cuda.is_available()  # (where CUDA is installed, its driver starts threads here, not
    # with the group: init_process_group asks for CUDA too)
    threads_before = _native_threads()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pat = DilatedPattern([8, 32], [1, 4])
    b, hq, hkv, s, d = 1, 4, 2, args.seq, 16
    g = torch.Generator().manual_seed(0)  # the same full sequence on every rank
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, generator=g) for h in (hq, hkv, hkv))
    pos = shard_positions(s, world, "zigzag")[rank]
    qs, ks, vs = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    if args.op == "ring":
        out = ring_attention(qs, ks, vs, pat, group=dist.group.WORLD, q_positions=pos,
                             k_positions=pos)
    else:
        out = dilated_attention(qs, ks, vs, pat, q_positions=pos, k_positions=pos)
    out.square().sum().backward()
    # float64 end to end: the shard's rows of the whole sequence's attention, each within the
    # sums' bound of the exact result (conftest.attention_tol), so twice that apart
    err = (out - dilated_attention(q, k, v, pat)[:, :, pos]).abs().max().item()
    if err > 2 * attention_tol(s, d, torch.float64) * max(1.0, out.abs().max().item()):
        print(f"rank {rank}: differs from the single-process op by {err:.3g}", file=sys.stderr)
        return 1
    if not args.release_outputs:
        _KEEP.append(out)
    if args.no_destroy:
        return 0
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    if group() is not None or _native_threads() > threads_before:
        print(f"rank {rank}: after destroy_process_group() the group is "
              f"{'still referenced' if group() is not None else 'released'}, native threads "
              f"{_native_threads()} (before init_process_group: {threads_before})",
              file=sys.stderr)
        return 3
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forked_runs(runs: int, argv) -> int:
    ranks = {}  # (run, rank) -> pid; every run at once, each on a port of its own
    for run in range(runs):
        env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        for rank in range(2):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # this rank leaves by SystemExit, up through the caller: a script's exit
                os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
                sys.exit(main(argv))
            ranks[run, rank] = pid
    failed = []
    for (run, rank), pid in ranks.items():
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            failed.append(f"run {run} rank {rank}: exit {code}")
    print("\n".join(failed) or f"{runs} forked runs: every rank exited 0", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if "--forked-runs" in sys.argv:
        at = sys.argv.index("--forked-runs")
        sys.exit(forked_runs(int(sys.argv[at + 1]), sys.argv[1:at] + sys.argv[at + 2:]))
    sys.exit(main())
