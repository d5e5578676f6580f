"""Per-rank summary of the Chrome traces ``bench_ring.py --profile --trace`` writes: where each
rank's ring step goes on the GPU.

    python examples/benchmarks/ring_trace_summary.py OUT_DIR      # reads OUT_DIR/trace_*.json

Per trace (one rank of one run): the GPU span from the first to the last kernel, the time some
compute kernel runs (NCCL excluded; overlapping kernels counted once), the idle rest (waits on
other ranks or on the host), the NCCL kernels' time, and the compute kernels by name (time and
launches). A rank whose compute time exceeds the others' sets the ring's pace.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def summarize(trace: dict) -> dict:
    """``{span_ms, busy_ms, idle_ms, nccl_ms, kernels: {name: (ms, launches)}}`` of one trace."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted((e for e in events if e.get("ph") == "X"
                  and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    if not gpu:
        return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, nccl_ms=0.0, kernels={})
    nccl = [e for e in gpu if "nccl" in e["name"].lower()]
    comp = [e for e in gpu if "nccl" not in e["name"].lower()]
    span = max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]
    busy, start, end = 0.0, None, None  # union of the compute kernels' intervals
    for e in comp:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or s > end:
            busy += 0.0 if end is None else end - start
            start, end = s, t
        else:
            end = max(end, t)
    busy += 0.0 if end is None else end - start
    time, count = Counter(), Counter()
    for e in comp:
        time[e["name"]] += e["dur"]
        count[e["name"]] += 1
    return dict(span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
                nccl_ms=sum(e["dur"] for e in nccl) / 1e3,
                kernels={n: (time[n] / 1e3, count[n]) for n, _ in time.most_common()})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="the --out-dir of bench_ring.py --profile --trace")
    p.add_argument("--top", type=int, default=4, help="kernels listed per rank (default 4)")
    args = p.parse_args(argv)
    files = sorted(Path(args.out_dir).glob("trace_*.json"))
    if not files:
        p.error(f"no trace_*.json in {args.out_dir}: run bench_ring.py --profile --trace")
    for f in files:
        s = summarize(json.loads(f.read_text()))
        top = ", ".join(f"{n[:24]} {ms:.1f} ms/{c}" for n, (ms, c) in
                        list(s["kernels"].items())[:args.top])
        print(f"{f.stem}: span {s['span_ms']:.1f} ms, compute {s['busy_ms']:.1f}, idle "
              f"{s['idle_ms']:.1f}, NCCL kernels {s['nccl_ms']:.1f}; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
