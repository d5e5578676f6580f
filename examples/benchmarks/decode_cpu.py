"""Decode on CPU: milliseconds per generated token after a long prompt, ``hilbert_dilated`` vs
``sdpa``, side by side in one run on one model.

    python examples/benchmarks/decode_cpu.py                         # contexts 4096 8192
    python examples/benchmarks/decode_cpu.py --contexts 4096 8192 --steps 60 --threads 1
    python examples/benchmarks/decode_cpu.py --profile 8192          # where decode time goes

A tiny random Llama (``--layers`` layers, hidden 256, 4 query / 2 key-value heads of 64, float32)
prefills ``C - 1`` tokens into a cache, then runs ``--steps`` single-token forwards (greedy), each
timed on its own after ``--warmup`` untimed ones. Rows: ``sdpa`` (DynamicCache),
``hilbert_dilated`` with ``--pattern`` (default: ``patterns/default.yaml``) and a ``DynamicCache``,
and the same with a :class:`~hf_hilbert_attn.PatternCache`. The measured steps of the three
rows are interleaved (one step of each in turn), so load from other processes falls on all of
them alike; the table gives the median and the least ms per token, and the ratio to ``sdpa``:
the median over rounds of a row's step time over the ``sdpa`` step of the same round (robust
to load that changes during the run). Below 2048 tokens the default pattern is dense; the
contexts here are past it, where the pattern is not.

Writes ``decode_cpu.csv`` into ``--out-dir`` (default ``hf_hilbert_results/decode_cpu``). ``--profile C``: a cProfile of the
decode steps at context ``C`` (``--profile-attn``, DynamicCache), top entries by own and by
cumulative time.
"""

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROWS = (("sdpa", "dynamic"), ("hilbert_dilated", "dynamic"), ("hilbert_dilated", "pattern"))


def build_model(layers: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         vocab_size=1024, max_position_embeddings=1 << 20,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def variant(base, attn: str, pattern=None):
    """A copy of ``base`` (same weights) running ``attn`` (hilbert_dilated: ``pattern``, None
    for the default one)."""
    import hf_hilbert_attn

    model = copy.deepcopy(base)
    if attn == "sdpa":
        model.set_attn_implementation("sdpa")
        return model
    return hf_hilbert_attn.configure(model, pattern)


def _forget_plans() -> None:
    from hf_hilbert_attn.engines import passes

    passes._PASS_CACHE.clear()  # (the decode plan lives in each forward's mask: nothing to clear)


class Decoder:
    """A prefilled cache and the next token: ``step()`` runs one single-token forward."""

    def __init__(self, model, cache_kind: str, ids: torch.Tensor, prefill_chunk: int):
        from transformers import DynamicCache

        from hf_hilbert_attn import PatternCache
        from hf_hilbert_attn.integrations.cache import cache_kwarg, prefill

        self.model, self.kw = model, cache_kwarg(model)
        cache = PatternCache(model) if cache_kind == "pattern" else \
            DynamicCache(config=model.config)
        self.cache = prefill(model, ids[:, :-1], chunk_tokens=prefill_chunk, cache=cache)
        self.token, self.pos = ids[:, -1:], ids.shape[1] - 1

    @torch.inference_mode()
    def step(self) -> float:
        """One decode step; its wall time in seconds. The rows decode the same positions in
        turn: the plans one row made are dropped first, so each step plans its own positions
        once (as a lone decoder does), and its layers share them."""
        _forget_plans()
        t0 = time.perf_counter()
        out = self.model(input_ids=self.token, position_ids=torch.tensor([[self.pos]]),
                         use_cache=True, **{self.kw: self.cache})
        self.token = out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        self.pos += 1
        return t1 - t0


def measure(base, context: int, steps: int, warmup: int, prefill_chunk: int, seed: int,
            pattern=None):
    """Median / min ms per token of each row of ``ROWS`` at ``context``, steps interleaved."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, base.config.vocab_size, (1, context), generator=gen)
    models = {attn: variant(base, attn, pattern) for attn in {a for a, _ in ROWS}}
    decs = [Decoder(models[attn], kind, ids, prefill_chunk) for attn, kind in ROWS]
    for d in decs:
        for _ in range(warmup):
            d.step()
    times = [[] for _ in decs]
    for _ in range(steps):
        for d, t in zip(decs, times):
            t.append(d.step())
    ref = times[0]  # sdpa: a row's ratio is the median over rounds of its step / sdpa's step
    return [dict(attn=attn, cache=kind, context=context, steps=steps,
                 ms_per_token=1e3 * statistics.median(t), min_ms=1e3 * min(t),
                 ratio_to_sdpa=statistics.median(x / y for x, y in zip(t, ref)))
            for (attn, kind), t in zip(ROWS, times)]


def profile(base, attn: str, context: int, steps: int, prefill_chunk: int, seed: int,
            top: int, pattern=None) -> str:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, base.config.vocab_size, (1, context), generator=gen)
    d = Decoder(variant(base, attn, pattern), "dynamic", ids, prefill_chunk)
    d.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        d.step()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per row")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pattern", default=None,
                   help="hilbert_dilated pattern: a shipped name, a YAML file or inline W:R "
                        "(default: the default pattern)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="hf_hilbert_results/decode_cpu")
    p.add_argument("--profile", type=int, default=None, metavar="C",
                   help="profile hilbert_dilated decode at context C instead of timing")
    p.add_argument("--profile-attn", choices=("hilbert_dilated", "sdpa"), default="hilbert_dilated")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import hf_hilbert_attn  # noqa: F401  (registers hilbert_dilated)
    from hf_hilbert_attn.tools.evaluation import resolve_pattern

    label, pattern = resolve_pattern(args.pattern) if args.pattern else ("default", None)
    base = build_model(args.layers, args.seed)
    if pattern is not None:
        try:  # dense key/value heads must exist in the model (2 key/value heads)
            pattern.check_kv_heads(base.config.num_key_value_heads)
        except ValueError as e:
            p.error(f"--pattern: {e}")
    if args.profile:
        print(profile(base, args.profile_attn, args.profile, args.steps, args.prefill_chunk,
                      args.seed, args.top, pattern))
        return 0
    rows = []
    for c in args.contexts:
        rows += measure(base, c, args.steps, args.warmup, args.prefill_chunk, args.seed,
                        pattern)
    print(f"decode on CPU ({torch.get_num_threads()} threads), {args.layers} layers, hidden 256, "
          f"4/2 heads x 64, float32, pattern {label}; median of {args.steps} steps")
    print(f"{'context':>8} {'attention':>16} {'cache':>8} {'ms/token':>9} {'min ms':>8} "
          f"{'vs sdpa':>8}")
    for r in rows:
        r["threads"] = torch.get_num_threads()
        r["pattern"] = label if r["attn"] == "hilbert_dilated" else ""
        print(f"{r['context']:>8} {r['attn']:>16} {r['cache']:>8} {r['ms_per_token']:>9.2f} "
              f"{r['min_ms']:>8.2f} {r['ratio_to_sdpa']:>7.2f}x")
    from hf_hilbert_attn.tools.evaluation.report import write_csv

    path = write_csv(rows, Path(args.out_dir) / "decode_cpu.csv")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
