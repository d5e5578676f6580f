"""A compiled training step, ``sdpa`` vs ``hilbert_dilated``: s/step and where the host time goes.

    python examples/benchmarks/compiled_step.py --seq 8192
    python examples/benchmarks/compiled_step.py --seq 8192 \
        --pattern configs/patterns/default_kv0_dense.yaml       # dense heads, sinks, sliding
    TORCH_LOGS=recompiles,graph_breaks python examples/benchmarks/compiled_step.py --seq 8192

SmolLM2-135M shape (random init, bf16, gradient checkpointing), decoder layers compiled one by
one (``tools.models.compile_layers``, as ``bench model --compile``), ``--pattern`` (default: the
default pattern), the model ``configure``d (positions decided before the layers: no graph
break, docs/decisions.md D48).
Per implementation: the mean of ``--steps`` steps after 3 warm-up steps, then a profile of one
step (top host functions). With ``TORCH_LOGS=recompiles,graph_breaks``, dynamo names any break.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from hf_hilbert_attn.tools.evaluation.bench_model import build_model, train_step
from hf_hilbert_attn.tools.models import MODEL_SHAPES


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--impls", nargs="+", default=["sdpa", "hilbert_dilated"],
                    choices=["sdpa", "hilbert_dilated"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pattern", default="default",
                    help="hilbert_dilated pattern: a shipped name, a YAML file or inline W:R")
    args = ap.parse_args(argv)
    from hf_hilbert_attn.tools.evaluation import resolve_pattern

    _, pattern = resolve_pattern(args.pattern)
    dev = torch.device("cuda")
    ids = torch.randint(0, 1000, (1, args.seq), device=dev)
    for impl in args.impls:
        torch._dynamo.reset()
        model = build_model(MODEL_SHAPES["135m"], impl, torch.bfloat16, dev,
                            pattern=None if impl == "sdpa" else pattern, compile=True)
        for _ in range(3):
            train_step(model, ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            train_step(model, ids)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t) / args.steps
        print(f"== {impl} compiled S={args.seq}: {per_step:.4f} s/step "
              f"({torch.cuda.get_device_name()})", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            train_step(model, ids)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=50))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
