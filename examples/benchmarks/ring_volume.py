"""Ring attention: bytes sent per rank per layer (vs a dense ring) and per-rank work, per layout.

Everything comes from the real send plan (``hf_hilbert_attn.ring.plan_ring``, the function the
ring itself runs) and the exact pair counter (``DilatedPattern.count_pairs``); no GPU needed.

    python examples/benchmarks/ring_volume.py                     # longnet_lm, 64K..1M, W 2/4/8
    python examples/benchmarks/ring_volume.py --seq-lens 65536 --worlds 8 --csv out.csv

Columns: ``fwd MB``: K+V bytes the busiest rank sends in one forward (bf16); ``fwd+bwd MB``:
plus the backward (K+V again, dK+dV in float32); ``dense MB``: the same for a ring that sends
every key (``(W-1)·S/W·Hkv·D`` entries); ``ratio``: ours / dense; ``pairs max/mean``: allowed
(query, key) pairs of the busiest rank over the mean (1.00 = perfect balance, causal).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
try:
    import hf_hilbert_attn  # noqa: F401
except ModuleNotFoundError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from hf_hilbert_attn import DilatedPattern  # noqa: E402
from hf_hilbert_attn.ring import plan_ring  # noqa: E402
from hf_hilbert_attn.sharding import LAYOUTS, pairs_per_rank, shard_positions  # noqa: E402


def volume(pattern, s, world, layout, hq, hkv, d, elem=2):
    """(max fwd bytes, max fwd+bwd bytes, dense fwd bytes, dense fwd+bwd bytes) per rank."""
    table = shard_positions(s, world, layout, pattern)
    pos = [table[r].unsqueeze(0) for r in range(world)]
    sent = [plan_ring(pattern, hq, hkv, True, r, pos, pos).entries_sent() for r in range(world)]
    fwd = max(sent) * d * elem * 2  # K and V
    bwd = max(sent) * d * (elem * 2 + 4 * 2)  # K, V again + dK, dV in float32
    dense_entries = (world - 1) * (s // world) * hkv
    return fwd, fwd + bwd, dense_entries * d * elem * 2, dense_entries * d * (elem * 4 + 8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", default=str(ROOT / "hf_hilbert_attn" / "patterns" / "longnet_lm.yaml"))
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    pattern = DilatedPattern.from_yaml(args.pattern)
    rows = []
    jobs = [(s, w, lay) for s in args.seq_lens for w in args.worlds for lay in args.layouts]
    for s, w, lay in tqdm(jobs, desc="plans", file=sys.stderr):
        t0 = time.perf_counter()
        fwd, tot, dfwd, dtot = volume(pattern, s, w, lay, args.hq, args.hkv, args.head_dim)
        pairs = pairs_per_rank(pattern, s, w, lay, num_heads=args.hq)
        mean = sum(pairs) / len(pairs)
        rows.append(dict(seq_len=s, world=w, layout=lay, fwd_MB=fwd / 2**20, fwdbwd_MB=tot / 2**20,
                         dense_fwd_MB=dfwd / 2**20, dense_fwdbwd_MB=dtot / 2**20,
                         ratio=fwd / dfwd if dfwd else 0.0, pairs_max_over_mean=max(pairs) / mean,
                         seconds=time.perf_counter() - t0))
    print(f"pattern {pattern}; Hq={args.hq}, Hkv={args.hkv}, D={args.head_dim}, bf16, causal; "
          "per rank per layer, busiest rank")
    print("| S | W | layout | fwd MB | fwd+bwd MB | dense fwd MB | dense fwd+bwd MB | ratio | "
          "pairs max/mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']:,} | {r['world']} | {r['layout']} | {r['fwd_MB']:.1f} | "
              f"{r['fwdbwd_MB']:.1f} | {r['dense_fwd_MB']:.1f} | {r['dense_fwdbwd_MB']:.1f} | "
              f"{r['ratio']:.3f} | {r['pairs_max_over_mean']:.3f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
