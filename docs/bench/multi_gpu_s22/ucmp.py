"""Ulysses head chunks (CHUNKS 1 / 2 / 4) beside the ring, interleaved in rounds, one process group.
torchrun --nproc_per_node W docs/bench/multi_gpu_s22/ucmp.py T1,T2 CHUNKS... (default pattern, Hq 32, Hkv 8, D 128, bf16)
CHUNKS is read by the variant only (ulysses_head_chunks_variant.py.txt, D61); on the final code
it has no effect: give 1."""
import os
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
import statistics, sys
import torch, torch.distributed as dist
from hf_hilbert_attn import dilated_attention
from hf_hilbert_attn.patterns import as_pattern
from hf_hilbert_attn.ring import ring_attention, ulysses
from hf_hilbert_attn.sharding import shard_positions

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
pat = as_pattern(sys.argv[3] if len(sys.argv) > 3 else "default")
Ts = [int(x) * 1024 for x in sys.argv[1].split(",")]
chunks = [int(x) for x in sys.argv[2].split(",")]
G = dist.group.WORLD


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        dist.barrier(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(t.item())
    return ts


for T in Ts:
    S = T * world
    full = None
    if rank == 0:
        g = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(1, 32, S, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(1, 8, S, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        v = torch.randn(1, 8, S, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        do = torch.randn_like(q)
        f = lambda: dilated_attention(q, k, v, pat).backward(do)
        for _ in range(2): f()
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        full = statistics.median(ts)
        del q, k, v, do
        torch.cuda.empty_cache()
    dist.barrier()
    g = torch.Generator(device=dev).manual_seed(2 + rank)
    q = torch.randn(1, 32, T, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, 8, T, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    do = torch.randn_like(q)
    for layout in ("contiguous", "zigzag"):  # each layout's variants interleaved in rounds
        pos = shard_positions(S, world, layout, pat)[rank].to(dev)
        variants = {f"ring/{layout}": (None, lambda: ring_attention(
            q, k, v, pat, group=G, q_positions=pos, k_positions=pos).backward(do))}
        for c in (chunks if layout == "contiguous" else chunks[-1:]):
            variants[f"ulysses c{c}/{layout}"] = (c, lambda: ulysses.ulysses_attention(
                q, k, v, pat, group=G, q_positions=pos, k_positions=pos).backward(do))
        res = {n: [] for n in variants}
        for n, (c, f) in variants.items():
            if c is not None: ulysses.CHUNKS = c
            for _ in range(2): f()
        for _ in range(4):  # rounds: every variant once per round
            for n, (c, f) in variants.items():
                if c is not None: ulysses.CHUNKS = c
                res[n] += timed(f, 2)
        if rank == 0:
            fw = f"{full / world:.2f}" if full else "-"
            for n, ts in res.items():
                m = statistics.median(ts)
                print(f"W={world} T={T // 1024}K {n}: {m:.2f} ms  full/W {fw} ms  "
                      f"{100 * full / world / m:.0f} %", flush=True)
    del q, k, v, do
    torch.cuda.empty_cache()
dist.destroy_process_group()
