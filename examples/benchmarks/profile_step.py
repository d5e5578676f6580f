"""Where a training step of a real model spends its time: ``sdpa`` vs ``hilbert_dilated``.

    python examples/benchmarks/profile_step.py --model /path/to/smollm2 --seq 8192 \
        --patterns dense hf_hilbert_attn/patterns/longnet_lm.yaml --steps 10 --profile

One forward + backward + AdamW step on random token ids of ``--seq`` tokens (bf16 autocast on
CUDA, as ``examples/finetune.py`` trains), timed per implementation in the same process (median
of ``--steps`` after two warm-up steps). ``--profile`` prints the top CUDA kernels and the
host time of one step per implementation (the question it answers: are we slower because of
kernels, launches, or host work between them). A small model at 8K tokens is where launch
counts and host work show; the attention op alone is timed by ``kernel_timing.py``.
``--device cpu``: float32, no autocast, a CPU profile: a smoke run, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hf_hilbert_attn  # noqa: E402
from hf_hilbert_attn.tools.evaluation import resolve_pattern  # noqa: E402


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _step(model, opt, ids, autocast):
    with torch.autocast("cuda" if autocast else "cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def run(model_dir, impl, pattern, seq, steps, profile, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=impl,
                                                 dtype=torch.float32).to(device)
    if pattern is not None:
        hf_hilbert_attn.configure(model, pattern)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=g).to(device)
    cuda = torch.device(device).type == "cuda"
    times = []
    for i in range(steps + 2):
        _sync(device)
        t = time.perf_counter()
        _step(model, opt, ids, autocast=cuda)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    text = ""
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            _step(model, opt, ids, autocast=cuda)
            _sync(device)
        text = prof.key_averages().table(sort_by="cuda_time_total" if cuda else
                                         "cpu_time_total", row_limit=18)
        if cuda:
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            launches = len(evs)
            gpu_ms = sum(e.device_time for e in evs) / 1e3
            text += (f"\nCUDA kernels launched in one step: {launches}, summed kernel time "
                     f"{gpu_ms:.1f} ms")
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times), text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local model directory")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--patterns", nargs="*", default=["longnet_lm"],
                    help="hilbert_dilated patterns (names, YAML paths, inline W:R); sdpa always runs")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", default="cuda",
                    help="cuda (default) or cpu: float32, no autocast (a smoke run)")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a CUDA GPU (or --device cpu for a smoke run)")
    from hf_hilbert_attn.tools.benchmarks.common import device_name

    print(device_name(args.device), "torch", torch.__version__)
    rows = [("sdpa", "sdpa", None)] + [(label, "hilbert_dilated", pat) for label, pat in
                                       (resolve_pattern(p) for p in args.patterns)]
    base = None
    out = []
    for label, impl, pat in rows:
        t, text = run(args.model, impl, pat, args.seq, args.steps, args.profile, args.device)
        base = base or t
        print(f"step {label:<28s} S={args.seq}: {t * 1e3:8.1f} ms  ({args.seq / t:,.0f} tokens/s, "
              f"{t / base:.2f}x sdpa)")
        out.append(dict(method=label, seq=args.seq, step_s=t, vs_sdpa=t / base))
        if text:
            print(text)
    return out


if __name__ == "__main__":
    main()
