"""Plans reused across layers and decode steps (``plan_cache``): the PyTorch path's blockwise
plans (``engines/passes.py``), the kernels' host planning (``kernels.plan_positions``) and a
model's decode plan (``decode.py``). A cached plan gives the same result as a fresh one, a tensor
changed in place (with or without a version counter) is planned again, the memo stays
bounded and is off under ``torch.compile``, and decoding a model still matches the reference.
CPU; the kernel calls run in the Triton interpreter.
"""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from hf_hilbert_attn import DilatedPattern, PatternCache, configure, dilated_attention, \
    reference_attention
from hf_hilbert_attn.engines import passes
from hf_hilbert_attn.inputs import check_inputs
from hf_hilbert_attn.integrations.cache import cache_kwarg
from hf_hilbert_attn.plan_cache import PlanCache
from helpers import assert_close

PATTERNS = [
    DilatedPattern([8, 16, 32], [1, 2, 4], window="sliding", sink_tokens=1),
    DilatedPattern([12, 20], [1, 3], query_dilation="all", sink_tokens=2),
]


def _qkv(b, hq, hkv, sq, sk, d=16, seed=0, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=dtype).requires_grad_(grad)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


class _Counting:
    """Wraps ``module.name`` and counts its calls (a plan made, not found)."""

    def __init__(self, monkeypatch, module, name):
        self.n, real = 0, getattr(module, name)

        def counted(*a, **kw):
            self.n += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, counted)


@pytest.fixture(autouse=True)
def _empty_caches():
    from hf_hilbert_attn.kernels import _plan

    for c in (passes._PASS_CACHE, _plan._PLANS):
        c.clear()
    yield


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_cached_plan_gives_the_fresh_result(monkeypatch, pattern):
    """Layer after layer (same positions, fresh q/k/v): one plan, reused; each call equal to
    one planned afresh (bit for bit) and to the reference, forward and backward."""
    made = _Counting(monkeypatch, passes, "_plan")
    sq, sk = 5, 70
    qpos = torch.tensor([[40, 50, 60, 61, 69], [3, 30, 64, 65, 66]])  # per-row positions
    for layer in range(3):
        q, k, v = _qkv(2, 4, 2, sq, sk, seed=layer, grad=True)
        out, lse = dilated_attention(q, k, v, pattern, q_positions=qpos,
                                     k_positions=torch.arange(sk), return_lse=True,
                                     backend="torch")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v))
        passes._PASS_CACHE.clear()  # planned afresh
        out2, lse2 = dilated_attention(q, k, v, pattern, q_positions=qpos,
                                       k_positions=torch.arange(sk), return_lse=True,
                                       backend="torch")
        grads2 = torch.autograd.grad((out2 * dout).sum() + lse2.sum(), (q, k, v))
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
        ro, rl = reference_attention(q, k, v, pattern, q_positions=qpos,
                                     k_positions=torch.arange(sk), return_lse=True)
        assert_close("out", out.detach(), ro.detach(), 1e-5, f"layer {layer}")
        assert_close("lse", lse.detach(), rl.detach(), 1e-5, f"layer {layer}")
        rg = torch.autograd.grad((ro * dout).sum() + rl.sum(), (q, k, v))
        for name, a, b in zip("qkv", grads, rg):
            assert_close(f"d{name}", a, b, 1e-5, f"layer {layer}")
    assert made.n == 1 + 3  # each layer's first call found the plan made before it


def test_few_queries_empty_rows_and_dtypes(monkeypatch):
    """A query whose document has no key outputs 0 with lse -inf; float64 and bfloat16 match
    the reference (bfloat16 within its rounding)."""
    pattern = PATTERNS[0]
    qd, kd = torch.tensor([[0, 2]]), torch.tensor([[0] * 20 + [1] * 20])
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        q, k, v = _qkv(1, 4, 1, 2, 40, dtype=dtype)
        kw = dict(q_positions=torch.tensor([[19, 39]]), q_doc_ids=qd, k_doc_ids=kd,
                  return_lse=True)
        out, lse = dilated_attention(q, k, v, pattern, backend="torch", **kw)
        ro, rl = reference_attention(q, k, v, pattern, dtype=torch.float64, **kw)
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert torch.isneginf(lse[:, :, 1]).all()
        assert_close("out", out, ro, tol, str(dtype))
        assert_close("lse", lse, rl, 1e-6, str(dtype))  # float32 for every input dtype


def test_positions_changed_in_place_are_planned_again(monkeypatch):
    """A plan is never stale: positions written in place (the version counter moves; inference
    tensors have none and are compared by content) give a new plan and the right result;
    equal content in another tensor finds the old plan."""
    made = _Counting(monkeypatch, passes, "_plan")
    pattern = PATTERNS[1]
    q, k, v = _qkv(1, 4, 2, 80, 80)
    for mode in (torch.no_grad, torch.inference_mode):
        passes._PASS_CACHE.clear()
        made.n = 0
        with mode():
            pos = torch.arange(80).flip(0).contiguous()  # explicit: the blockwise path
            first = dilated_attention(q, k, v, pattern, q_positions=pos, k_positions=pos,
                                      backend="torch")
            same = dilated_attention(q, k, v, pattern, q_positions=pos.clone(),
                                     k_positions=pos.clone(), backend="torch")
            assert made.n == 1 and torch.equal(first, same)
            pos[:40] = pos[:40].flip(0)  # in place: another permutation
            got = dilated_attention(q, k, v, pattern, q_positions=pos, k_positions=pos,
                                    backend="torch")
            assert made.n == 2
            want = reference_attention(q, k, v, pattern, q_positions=pos, k_positions=pos)
            assert_close("out", got, want, 1e-5, mode.__name__)


def test_small_positions_are_keyed_by_content(monkeypatch):
    """Decode positions ([1, 1]): a fresh tensor per step (or per layer) with the same value
    finds the plan; another value, or the same tensor changed in place, makes a new one."""
    made = _Counting(monkeypatch, passes, "_plan")
    pattern = PATTERNS[0]
    q, k, v = _qkv(1, 4, 2, 1, 60)
    outs = []
    with torch.inference_mode():
        pos = torch.tensor([[59]])
        for p in (59, 59, 40, 59):
            pos.fill_(p)
            outs.append(dilated_attention(q, k, v, pattern, q_positions=pos, backend="torch"))
        assert len(passes._PASS_CACHE) == 2  # 59 and 40
        assert torch.equal(outs[0], outs[3]) and not torch.equal(outs[0], outs[2])
        want = reference_attention(q, k, v, pattern, q_positions=torch.tensor([[40]]))
        assert_close("out", outs[2], want, 1e-5)
    assert made.n == 2  # the cache made two plans


def test_cache_is_bounded_and_keys_the_mode():
    cache = PlanCache(3, per_key=2)
    made = []
    for n in range(10):  # distinct keys
        cache.get_or_make(("k", n), (torch.arange(100),), lambda: made.append(1) or len(made))
    assert len(cache) == 3
    pos = [torch.randperm(100) for _ in range(5)]  # one key, distinct content
    for p in pos:
        cache.get_or_make(("same",), (p,), lambda: made.append(1) or len(made))
    assert len(cache) <= 3 * 2
    before = len(made)
    assert cache.get_or_make(("same",), (pos[-1],), lambda: -1) == before  # newest kept
    # a plan made in inference mode holds inference tensors: not handed to autograd calls
    with torch.inference_mode():
        a = cache.get_or_make(("m",), (pos[0],), lambda: torch.ones(1))
    b = cache.get_or_make(("m",), (pos[0],), lambda: torch.ones(1))
    assert a.is_inference() and not b.is_inference()


def test_plans_of_cpu_tensors_are_made_on_the_callers_thread(monkeypatch):
    # On a machine whose CUDA is initialized, plans of CUDA tensors are made on the cache's own
    # thread (plan_cache.kept); a plan of CPU tensors is made in place, in the caller's modes
    # (it went to that thread, where inference mode is off, on GPU machines)
    import hf_hilbert_attn.plan_cache as pc

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(pc, "_on_maker", lambda fn: pytest.fail("made on the cache's thread"))
    cache, pos = PlanCache(3), torch.randperm(100)
    with torch.inference_mode():
        assert cache.get_or_make(("m",), (pos,), lambda: torch.ones(1)).is_inference()
    assert not cache.get_or_make(("m",), (pos,), lambda: torch.ones(1)).is_inference()


def test_plan_made_in_inference_mode_then_used_with_autograd():
    """Decode under inference_mode, then a training step with the same positions."""
    pattern = PATTERNS[0]
    q, k, v = _qkv(1, 4, 2, 1, 50, grad=True)
    pos = torch.tensor([[49]])
    with torch.inference_mode():
        dilated_attention(q.detach(), k.detach(), v.detach(), pattern, q_positions=pos,
                          backend="torch")
    out = dilated_attention(q, k, v, pattern, q_positions=pos, backend="torch")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_no_caching_under_torch_compile():
    cache = PlanCache(4)

    def f(x):
        return cache.get_or_make(("c",), (x,), lambda: x + 1)

    torch._dynamo.reset()
    try:
        got = torch.compile(f, backend="eager")(torch.arange(5))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, torch.arange(1, 6)) and len(cache) == 0
    f(torch.arange(5))
    assert len(cache) == 1


def test_kernel_position_plans_are_reused_and_never_stale(monkeypatch):
    """``kernels.plan_positions``: one plan per positions (same tensor, or equal content), a new
    one after an in-place change; the interpreted kernels give the reference with either."""
    from hf_hilbert_attn import kernels
    from hf_hilbert_attn.kernels import _plan

    made = _Counting(monkeypatch, _plan, "_plan_positions")
    monkeypatch.setattr(kernels._config, "_CONFIG",
                        dataclasses.replace(kernels.kernel_config(), blocks=(16, 16)))
    pattern = DilatedPattern([8, 16], [1, 2])
    q, k, v = _qkv(1, 2, 1, 24, 24)
    pos = torch.randperm(24)
    a = check_inputs(q, k, v, pattern, q_positions=pos, k_positions=pos)
    p1, _ = kernels.plan_positions(a, pattern)
    p2, _ = kernels.plan_positions(check_inputs(q, k, v, pattern, q_positions=pos.clone(),
                                                k_positions=pos.clone()), pattern)
    assert p1 is p2 and made.n == 1 and p1.mapped
    for step in range(2):
        out = dilated_attention(q, k, v, pattern, q_positions=pos, k_positions=pos,
                                backend="triton")
        want = reference_attention(q, k, v, pattern, q_positions=pos, k_positions=pos)
        assert_close("out", out, want, 1e-4, f"step {step}")
        pos[:] = torch.randperm(24)  # in place: planned again
    assert made.n == 2
    p3, _ = kernels.plan_positions(check_inputs(q, k, v, pattern, q_positions=pos,
                                                k_positions=pos), pattern)
    assert made.n == 3 and torch.equal(p3.kinv[0, pos], torch.arange(24, dtype=torch.int32))


def _tiny(pattern):
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return configure(model, pattern)


def _decode(model, ids, cache, steps):
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        logits, tok = [out.logits[:, -1]], out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def test_decode_logits_match_the_reference(monkeypatch):
    """Greedy decode (DynamicCache and PatternCache) past the pattern's dense reach: every
    step's logits equal the same model whose attention is ``reference_attention``; one plan
    per step serves every layer."""
    from hf_hilbert_attn.integrations import transformers as integ

    pattern = PATTERNS[0]
    model = _tiny(pattern)
    ids = torch.randint(3, 96, (1, 70), generator=torch.Generator().manual_seed(1))
    steps = 5
    # (these few-key patterns read under half the keys: CPU steps decode through the op)
    made = _Counting(monkeypatch, passes, "_plan")
    got = {kind: _decode(model, ids, cache, steps) for kind, cache in
           (("dynamic", DynamicCache(config=model.config)), ("pattern", PatternCache(model)))}
    # at most one plan per decode step (not one per layer); the prefills take other paths
    assert 0 < made.n <= 2 * steps, made.n

    def reference(q, k, v, pattern, backend="auto", **kw):
        return reference_attention(q, k, v, pattern, **kw)

    monkeypatch.setattr(integ, "dilated_attention", reference)
    monkeypatch.setattr(integ, "decodes", lambda *a: False)  # every step through the op
    want = _decode(model, ids, DynamicCache(config=model.config), steps)
    for kind, logits in got.items():
        assert_close("logits", logits, want, 1e-4, kind)


def test_kept_tensors_are_made_on_one_thread_nested_calls_included():
    # Cached CUDA tensors are made on a thread of their own (outside any CUDA graph pool the
    # caller's thread fills); a kept plan making kept tables is a nested call, which must run
    # at once on that thread, not wait on it (on the GPU the first version hung there).
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from hf_hilbert_attn import plan_cache

    seen = []

    def inner():
        seen.append(threading.get_ident())
        return 7

    def outer():
        seen.append(threading.get_ident())
        return plan_cache._on_maker(inner)

    with ThreadPoolExecutor(1) as caller:
        assert caller.submit(plan_cache._on_maker, outer).result(timeout=60) == 7
        assert caller.submit(plan_cache._on_maker, inner).result(timeout=60) == 7
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    assert plan_cache.kept(lambda: torch.ones(2), "cpu").tolist() == [1.0, 1.0]
