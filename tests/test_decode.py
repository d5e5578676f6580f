"""Decoding as one plan per forward and one run per layer (``hf_hilbert_attn.decode``): the
decode kernel (on a CPU through Triton's interpreter) and the CPU's PyTorch run against ``reference_attention`` in float64
on fresh random patterns, positions and layouts, and a model's cached decode against its own
forward without a cache (which runs the op, not the decode path).
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import hf_hilbert_attn.decode as decode
from conftest import attention_tol, eps, model_tol
from helpers import assert_close, random_pattern
from hf_hilbert_attn import (DilatedPattern, PatternCache, configure, reference_attention,
                             set_dense_kv_heads)
from hf_hilbert_attn.decode import plan_decode, run_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def _kernel(monkeypatch, request):
    # on a CPU, the kernel through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)
    # and the PyTorch run (one fused SDPA call), which CPU decoding takes; on a GPU the kernel
    if request.param == "torch" and torch.cuda.is_available():
        pytest.skip("on a GPU, decoding runs the kernel")
    monkeypatch.setenv("HF_HILBERT_DECODE_KERNEL", "1" if request.param == "kernel" else "0")
    # the tiny patterns here read few of the keys: on a CPU the op would decode them (below)
    monkeypatch.setattr(decode, "CPU_KEY_RATIO", float("inf"))


def test_cpu_decodes_while_the_pattern_reads_half_the_keys(monkeypatch):
    # the default pattern (windows 2K..64K, rates 1..32) reads nearly all of 8K keys: the plan
    # and one fused call; of 32K keys it reads a fraction: the op's blockwise path
    from hf_hilbert_attn.patterns import default

    monkeypatch.undo()
    q = torch.randn(1, 4, 1, 16)
    for sk, takes in ((8192, True), (32768, False)):
        k = torch.randn(1, 2, sk, 16)
        assert decode.decodes(q, k, k, default()) == takes, sk


def _layout(rng, b, sq, sk, sinks):
    """(q_positions, k_positions, q_doc_ids, k_doc_ids, the cache's own layout or None) of a
    decode step, one of: the default (queries the last slots), left padding (rows with pads
    first), a PatternCache's slots (positions jump after the sinks). The cache's layout
    (``plan_decode``'s first query position and dropped keys, no tensors) where there is one."""
    kind = rng.choice(["default", "padded", "dropped"])
    if kind == "dropped" and sk - sq < sinks:  # a cache drops keys only past its sinks, which
        kind = "default"  # it holds before the step's queries (the newest slots)
    if kind == "default":
        return torch.arange(sk - sq, sk), torch.arange(sk), None, None, (sk - sq, 0)
    if kind == "dropped":
        gap = rng.randint(1, 40)
        slots = torch.arange(sk)
        kp = torch.where(slots < sinks, slots, slots + gap)
        return kp[-sq:], kp, None, None, (int(kp[-sq]), gap)
    pads = torch.tensor([rng.randint(0, sk - sq) for _ in range(b)])
    real = torch.arange(sk)[None] >= pads[:, None]  # [B, Sk]
    kp = (real.long().cumsum(-1) - 1).clamp_min(0)
    return (kp[:, -sq:], kp, torch.zeros(b, sq, dtype=torch.long), torch.where(real, 0, -1),
            None)


# bfloat16: on a GPU only (the interpreter's bfloat16 tl.dot is wrong)
DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available()


@pytest.mark.parametrize("dtype", DTYPES)
def test_run_matches_reference(dtype):
    rng = random.Random(torch.randint(2**31, ()).item())
    for case in range(4):  # the first: one key tile, so one split (no partial results)
        b, (hq, hkv) = rng.randint(1, 2), rng.choice([(6, 2), (4, 4), (3, 1), (8, 2)])
        sq, d = rng.randint(1, 5), 256 if case == 3 else rng.choice([16, 32])  # (256: Gemma)
        sk = rng.randint(sq + 1, 16) if case == 0 else rng.randint(20, 97)
        p = random_pattern(rng, sk, window=None, sinks=None)
        if rng.random() < 0.5:
            p = p.replace(dense_kv_heads=tuple(sorted(rng.sample(range(hkv), 1))))
        qp, kp, qd, kd, cache = _layout(rng, b, sq, sk, p.sink_tokens)
        q = torch.randn(b, hq, sq, d, dtype=dtype, device=DEV)
        k, v = (torch.randn(b, hkv, sk, d, dtype=dtype, device=DEV) for _ in range(2))
        qp, kp, qd, kd = (None if t is None else t.to(DEV) for t in (qp, kp, qd, kd))
        # soft-capped scores (Gemma 2) in every other case, where the kernel runs
        cap = 1.5 if case % 2 and decode._kernel(q) else None
        plan = plan_decode(p, hq, hkv, sk, qp, kp, q_doc_ids=qd, k_doc_ids=kd) \
            if cache is None or rng.random() < 0.5 else \
            plan_decode(p, hq, hkv, sk, cache[0], None, dropped=cache[1])
        out, lse = run_decode(q, k, v, plan, d ** -0.5, return_lse=True, softcap=cap)
        ref, ref_lse = reference_attention(
            *(t.double() for t in (q, k, v)), p, q_positions=qp, k_positions=kp, q_doc_ids=qd,
            k_doc_ids=kd, return_lse=True, softcap=cap, dtype=torch.float64)
        # float32: the sums' bound; half: float32 sums, the result and the probabilities fed
        # to P·V rounded to the input dtype (as tests/test_kernels.py: 20 of its eps)
        tol = attention_tol(sk, d) if dtype == torch.float32 else 20 * eps(dtype)
        what = (f"{p} b={b} heads={hq}/{hkv} sq={sq} sk={sk} d={d} softcap={cap} "
                f"cache layout {plan.in_cache_layout}")
        assert_close("out", out, ref, tol, what, elementwise=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert_close("lse", lse, ref_lse.float(), tol, what, elementwise=True)
        assert torch.all(out[~torch.isfinite(ref_lse)] == 0)


@pytest.mark.parametrize("window", ["sliding", "segment"])
def test_a_cache_layout_skips_the_keys_no_window_reaches(window):
    # In a cache's own layout the kernel leaves out the key tiles between the sinks' and the
    # first a query's windows reach (sparse heads; a dense head reads them all): windows of at
    # most 40 keys over 150-250 cached ones, with and without dropped keys and a dense head.
    rng = random.Random(torch.randint(2**31, ()).item())
    from hf_hilbert_attn.kernels._decode import DecodeLauncher, Rule

    for case in range(3):
        b, (hq, hkv), sq, d = 1, rng.choice([(4, 2), (6, 3)]), rng.randint(1, 3), 16
        sk, gap = rng.randint(150, 250), rng.choice([0, rng.randint(1, 60)])
        p = random_pattern(rng, max_w=40, min_w=8, window=window, sinks=rng.choice([1, 3, 20]))
        if case == 2:
            p = p.replace(dense_kv_heads=(hkv - 1,))
        first = sk - sq + gap  # the first query's position (slots past the sinks: + gap)
        launcher = DecodeLauncher(Rule(*[None] * 6, p.sink_tokens), p.sliding, True, False,
                                  False, tuple(w for w, _ in p.configs), case == 2)
        # (the interpreter's key tiles, 16 keys; at most 4 splits of a sparse head)
        ks, kl = launcher._skipped(first, gap, 16)  # (the kernel skips these at least)
        splits, dense_splits = launcher._split(sk, first, gap, 16, 4, 1)
        assert kl - ks >= 16 * 4, (p, sk, gap, ks, kl)  # the case skips tiles
        # a dense head takes more splits than a sparse head, of as many keys each
        assert (dense_splits > splits) == (case == 2), (p, sk, gap, splits, dense_splits)
        slots = torch.arange(sk)
        kp = torch.where(slots < p.sink_tokens, slots, slots + gap)
        q = torch.randn(b, hq, sq, d, device=DEV)
        k, v = (torch.randn(b, hkv, sk, d, device=DEV) for _ in range(2))
        plan = plan_decode(p, hq, hkv, sk, first, None, dropped=gap)
        out, lse = run_decode(q, k, v, plan, d ** -0.5, return_lse=True)
        ref, ref_lse = reference_attention(
            *(t.double() for t in (q, k, v)), p, q_positions=kp[-sq:].to(DEV),
            k_positions=kp.to(DEV), return_lse=True, dtype=torch.float64)
        what = f"{p} heads={hq}/{hkv} sq={sq} sk={sk} dropped={gap} skipped [{ks}, {kl})"
        assert_close("out", out, ref, attention_tol(sk, d), what, elementwise=True)
        assert_close("lse", lse, ref_lse.float(), attention_tol(sk, d), what, elementwise=True)


@pytest.mark.parametrize("splits", [(1, 3), (2, 5), (3, 3)])
def test_programs_past_a_heads_splits_leave_its_rows_alone(splits, monkeypatch):
    # A dense head's splits outnumber a sparse head's (the grid has the dense head's): the
    # sparse head's programs past its own splits must write nothing, its one split (1) write
    # the rows alone. Split counts forced; a cache's layout with a dense head, dropped keys.
    rng = random.Random(torch.randint(2**31, ()).item())
    from hf_hilbert_attn.kernels._decode import DecodeLauncher

    monkeypatch.setattr(DecodeLauncher, "_split", lambda self, *a: splits)
    for _ in range(2):
        p = random_pattern(rng, max_w=40, min_w=4, window=None, sinks=rng.choice([0, 2]))
        p = p.replace(dense_kv_heads=(1,))
        sq, sk, gap = rng.randint(1, 3), rng.randint(50, 120), rng.randint(0, 30)
        first = sk - sq + gap
        slots = torch.arange(sk)
        kp = torch.where(slots < p.sink_tokens, slots, slots + gap)
        q = torch.randn(1, 4, sq, 16, device=DEV)
        k, v = (torch.randn(1, 2, sk, 16, device=DEV) for _ in range(2))
        plan = plan_decode(p, 4, 2, sk, first, None, dropped=gap)
        out, lse = run_decode(q, k, v, plan, 0.25, return_lse=True)
        ref, ref_lse = reference_attention(
            *(t.double() for t in (q, k, v)), p, q_positions=kp[-sq:].to(DEV),
            k_positions=kp.to(DEV), return_lse=True, dtype=torch.float64)
        what = f"{p} splits={splits} sq={sq} sk={sk} dropped={gap}"
        assert_close("out", out, ref, attention_tol(sk, 16), what, elementwise=True)
        assert_close("lse", lse, ref_lse.float(), attention_tol(sk, 16), what, elementwise=True)


@pytest.mark.gpu
@pytest.mark.parametrize("window", ["sliding", "segment"])
def test_gpu_a_long_cache_splits_its_keys_by_head(window):
    # A 1B-shaped step (32 / 8 heads of 64, bfloat16) over 6-10K cached keys in a cache's
    # layout: each sparse head's key range computed in the kernel from its rows' windows (most
    # tiles skipped), a dense head split more finely than the others, sinks and dropped keys.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hf_hilbert_attn.kernels._decode import DecodeLauncher, Rule

    rng = random.Random(torch.randint(2**31, ()).item())
    p = DilatedPattern([256, 512, 1024, 2048], [1, 2, 4, 8], window=window, sink_tokens=4,
                       dense_kv_heads=(rng.randrange(8),))
    sk, gap, sq = rng.randint(6000, 10000), rng.choice([0, rng.randint(1, 5000)]), 1
    first = sk - sq + gap
    launcher = DecodeLauncher(Rule(*[None] * 6, 4), p.sliding, True, False, False,
                              tuple(w for w, _ in p.configs), True)
    splits, dense_splits = launcher._split(sk, first, gap, 64, 16, 8)
    assert dense_splits > splits  # (the keys past 2048 back: skipped by the sparse heads)
    slots = torch.arange(sk)
    kp = torch.where(slots < 4, slots, slots + gap).cuda()
    q = torch.randn(1, 32, sq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, sk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan = plan_decode(p, 32, 8, sk, first, None, dropped=gap)
    out, lse = run_decode(q, k, v, plan, 64 ** -0.5, return_lse=True)
    ref, ref_lse = reference_attention(*(t.double() for t in (q, k, v)), p,
                                       q_positions=kp[-sq:], k_positions=kp, return_lse=True,
                                       dtype=torch.float64)
    what = f"{p} sk={sk} dropped={gap}"  # (float32 sums; half-precision P·V as above)
    assert_close("out", out, ref, 20 * eps(torch.bfloat16), what, elementwise=True)
    assert_close("lse", lse, ref_lse.float(), 20 * eps(torch.bfloat16), what, elementwise=True)


def test_layers_of_a_step_relaunch_the_kernel_their_layout_compiled():
    # Every layer after a step's first relaunches the kernel compiled for the first layer while
    # the dtypes, strides and 16-byte alignments of its tensors are unchanged (on a GPU; the
    # interpreter binds every call): fresh data, then the same layout 2 elements into a larger
    # buffer (not 16-byte aligned: another specialization, bound again), then aligned again
    # (the first kernel, found in the launch's slot), each against the float64 reference.
    import hf_hilbert_attn.kernels._launch as kl

    rng = random.Random(torch.randint(2**31, ()).item())
    p = random_pattern(rng, 80, window=None, sinks=None)
    b, hq, hkv, sq, sk, d = 1, 4, 2, 2, 80, 16
    qp, kp = torch.arange(sk - sq, sk, device=DEV), torch.arange(sk, device=DEV)
    plan = plan_decode(p, hq, hkv, sk, qp, kp)
    before = kl.fast_launches
    for offset in (0, 0, 2, 0):
        buf = torch.randn(b * hq * sq * d + offset, device=DEV)
        q = buf[offset:].view(b, hq, sq, d)
        k, v = (torch.randn(b, hkv, sk, d, device=DEV) for _ in range(2))
        out, lse = run_decode(q, k, v, plan, d ** -0.5, return_lse=True)
        ref, ref_lse = reference_attention(*(t.double() for t in (q, k, v)), p, q_positions=qp,
                                           k_positions=kp, return_lse=True,
                                           dtype=torch.float64)
        what = f"{p} q at element {offset}"
        assert_close("out", out, ref, attention_tol(sk, d), what, elementwise=True)
        assert_close("lse", lse, ref_lse.float(), attention_tol(sk, d), what, elementwise=True)
    if DEV == "cuda" and kl.fast_launches_enabled():  # the second and the last call
        assert kl.fast_launches - before == 2


def test_the_steps_of_a_generation_share_one_launch():
    # In a cache's own layout (no position tensors) every step's plan takes the launcher of its
    # pattern and heads: on a GPU each step after the first relaunches the first step's kernel,
    # its key count and positions new (a PatternCache's dropped keys too), each against the
    # float64 reference
    import hf_hilbert_attn.kernels._launch as kl

    rng = random.Random(torch.randint(2**31, ()).item())
    p = random_pattern(rng, 90, window=None, sinks=None)
    b, hq, hkv, d, dropped = 1, 4, 2, 16, rng.choice([0, 7])
    made, before = [], kl.fast_launches
    for sk in (70, 71, 72, 90):
        q = torch.randn(b, hq, 1, d, device=DEV)
        k, v = (torch.randn(b, hkv, sk, d, device=DEV) for _ in range(2))
        plan = plan_decode(p, hq, hkv, sk, sk - 1 + dropped, None, dropped=dropped)
        out, lse = run_decode(q, k, v, plan, d ** -0.5, return_lse=True)
        made.append(plan._made)
        qp, kp = plan.positions(1, DEV)
        ref, ref_lse = reference_attention(*(t.double() for t in (q, k, v)), p, q_positions=qp,
                                           k_positions=kp, return_lse=True,
                                           dtype=torch.float64)
        what = f"{p} sk={sk} dropped={dropped}"
        assert_close("out", out, ref, attention_tol(sk, d), what, elementwise=True)
        assert_close("lse", lse, ref_lse.float(), attention_tol(sk, d), what, elementwise=True)
    if decode._kernel(q):
        assert all(m is made[0] for m in made)
    if DEV == "cuda" and kl.fast_launches_enabled():
        assert kl.fast_launches - before == 3
    with pytest.raises(ValueError, match="cache's own layout"):
        plan_decode(p, hq, hkv, 70, torch.tensor([69]), None)


def test_a_query_with_no_allowed_key_outputs_zero():
    # its document has no key: out 0 and lse -inf (SDPA's own answer there would be lse 0)
    p = random_pattern(random.Random(0), 40, window=None, sinks=None)
    q = torch.randn(1, 4, 2, 16, device=DEV)
    k, v = (torch.randn(1, 2, 40, 16, device=DEV) for _ in range(2))
    qd, kd = torch.tensor([[0, 2]], device=DEV), torch.tensor([[0] * 20 + [1] * 20], device=DEV)
    plan = plan_decode(p, 4, 2, 40, torch.tensor([[19, 39]], device=DEV),
                       torch.arange(40, device=DEV), q_doc_ids=qd, k_doc_ids=kd)
    out, lse = run_decode(q, k, v, plan, 0.25, return_lse=True)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isfinite(lse[:, :, 0]).all()


VOCAB = 96


def _tiny(pattern, layers=2):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEV).eval()
    return configure(model, pattern)


@pytest.mark.parametrize("dense", [[[1], [], []], [[1]] * 3], ids=["by_layer", "alike"])
def test_cached_decode_equals_the_forward_without_cache(dense):
    """Prefill, then teacher-forced decode steps of one and of three tokens, with a left-padded
    row and dense heads per layer or alike (a step's later layers then run its first layer's
    prepared call): every position's logits equal the model's forward over the whole sequence
    (which runs the op, not the decode path), DynamicCache and PatternCache."""
    rng = random.Random(torch.randint(2**31, ()).item())
    pattern = random_pattern(rng, max_w=24, min_w=4, window=None, sinks=rng.choice([0, 1, 3]))
    model = set_dense_kv_heads(_tiny(pattern, layers=3), dense)
    n, pre = 34, 23
    ids = torch.randint(3, VOCAB, (2, n), device=DEV)
    mask = torch.ones(2, n, dtype=torch.long, device=DEV)
    mask[1, :3] = 0  # left padding
    with torch.inference_mode():
        want = model(input_ids=ids, attention_mask=mask).logits
        for cache in (DynamicCache(config=model.config), PatternCache(model)):
            if isinstance(cache, PatternCache):
                ids, mask, want = ids[:1], mask[:1], want[:1]  # PatternCache: unpadded rows
            got = [model(input_ids=ids[:, :pre], attention_mask=mask[:, :pre],
                         past_key_values=cache, use_cache=True).logits]
            t = pre
            while t < n:
                step = 1 if t < pre + 5 else 3
                got.append(model(input_ids=ids[:, t:t + step], attention_mask=mask[:, :t + step],
                                 past_key_values=cache, use_cache=True).logits)
                t += step
            got = torch.cat(got, 1)
            real = mask.bool()
            tol = model_tol(n, 64)
            scale = want[real].abs().max()
            err = (got - want)[real].abs().max()
            assert err <= tol * scale, f"{type(cache).__name__} {pattern}: {err:.3g}"


def test_a_decode_step_skips_the_position_hook(monkeypatch):
    # the model's pre-hook decides positions for a call without a cache (a host sync for
    # restarting positions); a decode step passes its cache, under either of the names
    # Transformers has used ("cache", "past_key_values"), and the hook leaves it alone
    import hf_hilbert_attn.integrations.transformers as tf
    from hf_hilbert_attn.integrations.cache import cache_kwarg

    calls, real = [], tf.model_positions
    monkeypatch.setattr(tf, "model_positions",
                        lambda *a, **k: calls.append(a[3:7]) or real(*a, **k))
    model = _tiny(random_pattern(random.Random(5), max_w=16, min_w=4))
    ids = torch.randint(3, VOCAB, (1, 20), device=DEV)
    with torch.inference_mode():
        for name in {cache_kwarg(model), "past_key_values"}:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :19], use_cache=True, **{name: cache})
            calls.clear()
            model(input_ids=ids[:, 19:], use_cache=True, **{name: cache})
            # (offset, batch, Sq, Sk) of each call: none is the hook's (offset 0, Sq == Sk == 1)
            assert all(c[0] != 0 or c[2] != c[3] for c in calls), (name, calls)


def test_one_plan_per_forward(monkeypatch):
    """Every layer of a step shares the step's plan: one per distinct layer pattern and key
    count (here: a layer with a dense head and one without)."""
    made = []
    real = decode.plan_decode

    def counting(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    import hf_hilbert_attn.integrations.transformers as tf

    monkeypatch.setattr(tf, "plan_decode", counting)
    model = _tiny(random_pattern(random.Random(3), max_w=16, min_w=4), layers=4)
    ids = torch.randint(3, VOCAB, (1, 20), device=DEV)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :19], past_key_values=cache, use_cache=True)
        made.clear()
        model(input_ids=ids[:, 19:], past_key_values=cache, use_cache=True)
        assert len(made) == 1, made
        set_dense_kv_heads(model, [[0], [], [0], []])
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        assert len(made) == 3 and len(set(made[1:])) == 2, made


def test_a_decode_step_is_one_launch_per_layer_and_one_check_per_forward(monkeypatch):
    """A decode step of a 4-layer model: the kernel is launched once per layer (the splits'
    merge inside it; on a CPU the PyTorch run is one SDPA call per layer), and the per-layer
    checks run once for the step (``_checked_pattern``), again where a layer's pattern differs;
    on the kernel the layers after the first of their pattern run its prepared call."""
    import hf_hilbert_attn.integrations.transformers as tf
    import hf_hilbert_attn.kernels._decode as kd

    launches, checks, prepared = [], [], []
    real_prepared = decode.PreparedDecode.__call__
    monkeypatch.setattr(decode.PreparedDecode, "__call__",
                        lambda self, *a: prepared.append(1) or real_prepared(self, *a))
    real_launch, real_relaunch, real_check = kd.launch_all, kd.relaunch, tf.check_call
    monkeypatch.setattr(kd, "launch_all", lambda ls, memo=None: launches.extend(x[0] for x in ls)
                        or real_launch(ls, memo))
    # (a layer after the first relaunches the kernel its layout compiled)
    monkeypatch.setattr(kd, "relaunch", lambda kernel, *a: launches.append(kernel)
                        or real_relaunch(kernel, *a))
    monkeypatch.setattr(tf, "check_call", lambda *a: checks.append(a[0]) or real_check(*a))
    sdpa = decode._SDPA_CPU
    if sdpa is not None:
        monkeypatch.setattr(decode, "_SDPA_CPU", lambda *a, **k: launches.append("sdpa")
                            or sdpa(*a, **k))
    model = _tiny(random_pattern(random.Random(4), max_w=16, min_w=4), layers=4)
    ids = torch.randint(3, VOCAB, (1, 20), device=DEV)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :19], past_key_values=cache, use_cache=True)
        launches.clear(), checks.clear()
        model(input_ids=ids[:, 19:], past_key_values=cache, use_cache=True)
        assert len(launches) == 4, launches
        assert len(checks) == 1, checks
        assert len(prepared) == (3 if "sdpa" not in launches else 0), prepared
        set_dense_kv_heads(model, [[0], [], [0], []])
        checks.clear(), prepared.clear()
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        assert len(checks) == 4, checks  # per-layer dense heads: a pattern per layer
        # (layers 3 and 4 have the patterns of 1 and 2: they run those layers' prepared calls)
        assert len(prepared) == (2 if "sdpa" not in launches else 0), prepared


def test_static_cache_generate_compiles_to_one_graph():
    """generate() with a static cache compiles its decode steps (on a GPU with CUDA graphs,
    "reduce-overhead"): traced with fullgraph=True, the step has no graph break (positions, plan
    and run inside the graph, the run one custom op) and its tokens and logits equal the eager
    generate's, with a left-padded row and a dense head."""
    from transformers import CompileConfig

    rng = random.Random(torch.randint(2**31, ()).item())
    pattern = random_pattern(rng, max_w=24, min_w=4, window=None, sinks=rng.choice([0, 1]))
    model = set_dense_kv_heads(_tiny(pattern), [[1], []])
    ids = torch.randint(3, VOCAB, (2, 30), device=DEV)
    mask = torch.ones(2, 30, dtype=torch.long, device=DEV)
    mask[1, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
              pad_token_id=0, cache_implementation="static", output_logits=True,
              return_dict_in_generate=True)
    eager = model.generate(ids, disable_compile=True, **kw)
    config = CompileConfig(fullgraph=True, backend="eager")  # no inductor: seconds, not minutes
    config._compile_all_devices = True  # (Transformers compiles on a GPU only, by default)
    torch._dynamo.reset()
    try:
        compiled = model.generate(ids, compile_config=config, **kw)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(compiled.logits, eager.logits)):
        assert torch.equal(a, b), step
