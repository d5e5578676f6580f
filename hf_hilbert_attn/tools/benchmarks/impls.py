"""The rows of the attention benchmark (:mod:`.attention`): each implementation it times
side by side on the same inputs, behind one small interface (:class:`Impl`)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hf_hilbert_attn import dilated_attention

from . import common as C
from .baselines import (FlexDilated, build_gather_plan, gather_kernel_names, gather_pairs,
                        gather_sdpa_attention)

KEYS = ("ours-natural", "ours-hilbert", "sdpa-cudnn", "sdpa-flash", "gather-sdpa", "flex")


# ============================================================================= implementations
class Impl:
    """One row's function: ``fwd()`` returns the output in its storage order; ``natural(out)``
    returns the last ``n`` queries in position order; the backward uses ``dout``."""

    note = ""
    build_s = float("nan")
    compile_s = float("nan")

    def __init__(self, ctx):
        self.ctx = ctx
        self.leaves = [ctx["q"], ctx["k"], ctx["v"]]
        self.dout = ctx["do"]

    def fwd(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def natural(self, out, n):
        return out[:, :, -n:]

    def pairs(self):
        """Pairs the row's own function computes (its own TFLOP/s)."""
        return self.ctx["pattern_pairs"]

    def own_reference(self):
        return "pattern"


class Ours(Impl):
    def __init__(self, ctx, hilbert: bool):
        super().__init__(ctx)
        self.backend = ctx["args"].ours_backend
        self.pos = None
        if hilbert:
            from hf_hilbert_attn.hilbert import hilbert_permutation

            t0 = time.perf_counter()
            perm, inv = hilbert_permutation(ctx["S"], ctx["pattern"], ctx["device"])
            C.synchronize(ctx["device"])
            self.build_s = time.perf_counter() - t0
            self.pos, self.inv = perm, inv
            # The layout is applied once, outside the timed region (it is how tokens are stored).
            with torch.no_grad():
                self.leaves = [t.detach()[:, :, perm].contiguous().requires_grad_()
                               for t in (ctx["q"], ctx["k"], ctx["v"])]
                self.dout = ctx["do"][:, :, perm].contiguous()
            self.note = "permutation outside the timed region"

    def fwd(self):
        q, k, v = self.leaves
        return dilated_attention(q, k, v, self.ctx["pattern"], causal=True, backend=self.backend,
                                 q_positions=self.pos, k_positions=self.pos)

    def natural(self, out, n):
        if self.pos is None:
            return out[:, :, -n:]
        return out[:, :, self.inv[-n:]]


class SDPA(Impl):
    def __init__(self, ctx, backend_name: str):
        super().__init__(ctx)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if ctx["device"].type != "cuda":
            raise Unavailable(f"{backend_name} SDPA needs CUDA")
        self.sdpa_kernel = sdpa_kernel
        self.backend = {"cudnn": SDPBackend.CUDNN_ATTENTION,
                        "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
        self.group = ctx["hq"] // ctx["hkv"]
        self.expand = False
        self.note = "mha" if self.group == 1 else "gqa: enable_gqa=True (native)"

    def fallback_to_expanded(self):
        self.expand = True
        self.note = "gqa: K/V expanded by repeat_interleave inside the timed region"

    def fwd(self):
        q, k, v = self.leaves
        with self.sdpa_kernel([self.backend]):
            if self.group == 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if self.expand:
                return F.scaled_dot_product_attention(
                    q, k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1),
                    is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def pairs(self):
        S = self.ctx["S"]
        return self.ctx["hq"] * S * (S + 1) // 2

    def own_reference(self):
        return "dense"


class Gather(Impl):
    def __init__(self, ctx):
        super().__init__(ctx)
        pattern = ctx["pattern"]
        if pattern.sliding:
            raise Unavailable("gather-sdpa gathers fixed segments; a sliding-window pattern "
                              "has none")
        t0 = time.perf_counter()
        self.plan = build_gather_plan(ctx["pattern"], ctx["S"], ctx["hq"], ctx["hkv"], ctx["device"])
        C.synchronize(ctx["device"])
        self.build_s = time.perf_counter() - t0
        self.kernel = ctx["args"].gather_kernel
        self.skipped = [what for what, on in (("sink keys", pattern.sink_tokens),
                                              ("dense heads", pattern.dense_kv_heads)) if on]

    def fwd(self):
        q, k, v = self.leaves
        return gather_sdpa_attention(q, k, v, self.ctx["pattern"], causal=True, plan=self.plan,
                                     kernel=self.kernel)

    def describe(self):
        names = gather_kernel_names(self.ctx["q"], self.plan, causal=True, kernel=self.kernel)
        self.note = "index tables built before timing; segment kernel: " + ", ".join(names)
        if self.skipped:  # the configs alone: the pattern's sinks / dense heads are not run
            self.note += f"; configs only (no {' or '.join(self.skipped)})"

    def pairs(self):
        return gather_pairs(self.ctx["pattern"], self.ctx["S"], self.ctx["hq"], causal=True)

    def own_reference(self):
        return "double-counted"


class Flex(Impl):
    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx["device"].type != "cuda":
            raise Unavailable("compiled FlexAttention is benchmarked on CUDA only")
        import torch._dynamo

        # Every (shape, pattern) is a new graph: without a larger cache dynamo would fall back to
        # eager flex_attention, which materialises the S x S scores.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
        torch._dynamo.reset()  # compile time measured from scratch for each row
        self.flex = FlexDilated(ctx["pattern"], ctx["S"], ctx["hq"], ctx["device"], causal=True,
                                num_kv_heads=ctx["hkv"])
        self.build_s = self.flex.build_s
        self.note = ("block mask (per head) built once, build_s = create_block_mask; "
                     + ("mha" if ctx["hq"] == ctx["hkv"] else "gqa: enable_gqa=True"))

    def fwd(self):
        q, k, v = self.leaves
        return self.flex(q, k, v)


class Unavailable(Exception):
    """The implementation cannot run here (no CUDA, missing module); recorded, not an error."""


def make_impl(key, ctx):
    if key == "ours-natural":
        return Ours(ctx, hilbert=False)
    if key == "ours-hilbert":
        return Ours(ctx, hilbert=True)
    if key == "sdpa-cudnn":
        return SDPA(ctx, "cudnn")
    if key == "sdpa-flash":
        return SDPA(ctx, "flash")
    if key == "gather-sdpa":
        return Gather(ctx)
    if key == "flex":
        return Flex(ctx)
    raise ValueError(f"unknown impl {key!r}; known: {list(KEYS)}")
