"""Decode steps of one model with parts of our layer call swapped, interleaved step by step in
one process: where the time a step of ours spends beyond SDPA's (flash) goes.

python step_variants.py SHAPE CTX STEPS
  sdpa-flash     the model with attn_implementation="sdpa", under SDPA's flash backend
  ours           hilbert_dilated, default pattern
  ours/no-launch our whole host path, the decode kernel's launch skipped (output left empty)
  ours/flash-run our layer call up to run_decode, which SDPA (flash) replaces
  ours/kept      a step's first launch finds the kernel its layout compiled (no Triton binding)
  ours/timed     launches timed inside the step (printed: us per step in launch_all)
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_hilbert_attn
import hf_hilbert_attn.kernels._decode as kd
from hf_hilbert_attn import prefill
from hf_hilbert_attn.integrations import transformers as hi
from hf_hilbert_attn.tools.models import MODEL_SHAPES

shape, ctx, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")


def build(ours: bool):
    torch.manual_seed(0)
    with dev:
        m = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1 << 22, **MODEL_SHAPES[shape]))
    m.to(torch.bfloat16).eval()
    if not ours:
        m.set_attn_implementation("sdpa")
        return m
    return hf_hilbert_attn.configure(m, hf_hilbert_attn.patterns.as_pattern("default"))


real_launch, real_run = kd.launch_all, hi.run_decode
from hf_hilbert_attn.kernels import _launch  # noqa: E402
from triton import knobs  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

_KEPT = {}


def kept_launch(launches):
    """launch_all, but a missed slot takes the kernel its layout compiled before (exact guard
    over every argument, as the slot's; scalars apart)."""
    for fn, grid, head, rest, kw, slot in launches:
        g, vals = _launch._addresses((*head, *rest[:-1]))
        key = (fn, g, tuple(sorted((n, v) for n, v in kw.items())))
        hit = _KEPT.get(key)
        if hit is None:
            _KEPT[key] = real_launch([(fn, grid, head, rest, kw, slot)]) or \
                next(iter(slot.values()))[0]
            continue
        kernel = hit
        names = fn.arg_names[len(head) + len(rest):]
        values = (*vals, rest[-1], *(kw[n] for n in names))
        dev_ = driver.active.get_current_device()
        stream = driver.active.get_current_stream(dev_)
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *values)


spent = [0.0]
parts = {"address": 0.0, "metadata": 0.0, "run": 0.0, "n": 0}


def parts_launch(launches):
    """launch_all's hit path with each part timed (a miss: launch_all itself)."""
    for fn, grid, head, rest, kw, slot in launches:
        t0 = time.perf_counter()
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        h = (device, *_launch._addresses(head))
        hit = slot.get((h[0], h[1], rest[-1] if rest else None))
        if hit is None:
            real_launch([(fn, grid, head, rest, kw, slot)])
            continue
        kernel, tail, addressed = hit
        values = (*h[2], *addressed, *tail)
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        t1 = time.perf_counter()
        meta = kernel.launch_metadata(grid, stream, *values)
        t2 = time.perf_counter()
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
        t3 = time.perf_counter()
        parts["address"] += t1 - t0
        parts["metadata"] += t2 - t1
        parts["run"] += t3 - t2
        parts["n"] += 1


def timed_launch(launches):
    t0 = time.perf_counter()
    real_launch(launches)
    spent[0] += time.perf_counter() - t0


def flash_run(q, k, v, plan, scale, return_lse=False, softcap=None):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


variants = {"sdpa-flash": (False, real_launch, real_run), "ours": (True, real_launch, real_run),
            "ours/no-launch": (True, lambda launches: None, real_run),
            "ours/flash-run": (True, real_launch, flash_run),
            "ours/kept": (True, kept_launch, real_run), "ours/timed": (True, timed_launch, real_run),
            "ours/parts": (True, parts_launch, real_run)}
models = {False: build(False), True: build(True)}
with torch.inference_mode():
    ids = torch.randint(3, 1000, (1, ctx), device=dev)
    state = {}
    for name, (ours, _, _) in variants.items():
        cache = prefill(models[ours], ids, chunk_tokens=16384,
                        cache=DynamicCache(config=models[ours].config))
        state[name] = [cache, ids[:, -1:]]
    times = {n: [] for n in variants}
    for i in range(steps + 3):
        for name, (ours, launch, run) in variants.items():
            kd.launch_all, hi.run_decode = launch, run
            cache, tok = state[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if not ours else \
                    torch.autocast("cuda", enabled=False):
                out = models[ours](input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            if i >= 3:
                times[name].append((time.perf_counter() - t0) * 1e3)
            state[name][1] = ids[:, -1:]  # (the same token: outputs of skipped runs are junk)
    kd.launch_all, hi.run_decode = real_launch, real_run
    base = times["sdpa-flash"]
    print(f"{shape} ctx={ctx} {torch.cuda.get_device_name()}: " + "  ".join(
        f"{n} {statistics.median(t):.2f} ms (x{statistics.median([a / b for a, b in zip(t, base)]):.3f})"
        for n, t in times.items()), flush=True)
    print(f"launch_all inside the steps: {spent[0] / (steps + 3) * 1e6:.0f} us per step; per "
          f"launch that hit its slot: " + ", ".join(f"{k} {v / max(parts['n'], 1) * 1e6:.1f} us"
                                                     for k, v in parts.items() if k != "n"))
