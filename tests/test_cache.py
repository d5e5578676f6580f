"""PatternCache (a KV cache bounded by the pattern), chunked prefill, and their use by the eval
and the generation benchmark. CPU, tiny random Llama / Qwen2 models (GQA: 4 query heads, 2 KV
heads of 16), the PyTorch attention path (one test also the Triton kernels, interpreted).

The reference for every step is the same model with a full ``DynamicCache``; the patterns'
segments and windows are far shorter than the sequences, so a dropped key that was still
needed, or a key given the wrong position, changes the logits.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

from hf_hilbert_attn import DilatedPattern, PatternCache, configure, prefill
from hf_hilbert_attn.integrations.cache import cache_kwarg, prefill_chunks
from conftest import attention_tol, eps, model_tol
from helpers import random_pattern

VOCAB = 96


def tiny(family: str = "llama", pattern: DilatedPattern = None):  # head_dim 16: kernel-sized
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = LlamaConfig(**kw) if family == "llama" else Qwen2Config(use_sliding_window=False, **kw)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return configure(model, pattern)


def run(model, ids, cache, chunk: int, steps: int):
    """Chunked prefill of ``ids`` then ``steps`` greedy decode steps: (logits of every position,
    the tokens, the keys stored per layer after each step)."""
    logits = [lg for _, _, lg in prefill_chunks(model, ids, chunk_tokens=chunk, cache=cache,
                                                logits_from=0)]
    stored, tok = [], logits[-1][:, -1:].argmax(-1)
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
            logits.append(out.logits)
            tok = out.logits[:, -1:].argmax(-1)
            stored.append([layer.keys.shape[-2] for layer in cache.layers])
    return torch.cat(logits, dim=1), stored


CASES = [  # (family, pattern): segments / sliding, sinks or not, dilation, nested or not
    ("llama", DilatedPattern([8, 16], [1, 2])),
    ("qwen2", DilatedPattern([8, 16], [1, 4], query_dilation="all", sink_tokens=2)),
    ("llama", DilatedPattern([6, 16], [1, 4], window="sliding", sink_tokens=3)),
    ("qwen2", DilatedPattern([5, 12], [1, 3], window="sliding")),
    # lcm 30 > the longest segment: no alignment, the tail runs with explicit positions
    ("llama", DilatedPattern([6, 10], [1, 3], sink_tokens=1)),
]


@pytest.mark.parametrize("family,pattern", CASES, ids=[str(p) for _, p in CASES])
def test_every_step_matches_the_full_cache_and_memory_stays_bounded(family, pattern):
    model = tiny(family, pattern)
    ids = torch.randint(3, VOCAB, (2, 37))
    chunk = random.choice([5, 7, 11])  # odd chunk sizes: chunks straddle segment boundaries
    steps = 3 * pattern.max_segment + 8
    cache = PatternCache(model)
    got, stored = run(model, ids, cache, chunk, steps)
    want, _ = run(model, ids, DynamicCache(config=model.config), 37, steps)
    scale = want.abs().max()
    tol = model_tol(37 + steps, 64)  # attention rows of every key so far, 64 features
    for t in range(got.shape[1]):
        err = (got[:, t] - want[:, t]).abs().max()
        assert err <= tol * scale, f"position {t}: max |diff| {err:.3g} (chunk {chunk})"
    # Bounded by the pattern, and the bound is reached: flat over a long generation.
    bound = cache.max_stored_tokens
    assert bound <= pattern.sink_tokens + pattern.max_segment - 1 + cache.align - 1
    flat = [max(s) for s in stored]
    assert max(flat) <= bound, f"stored {max(flat)} keys > bound {bound}"
    assert max(flat[-pattern.max_segment - cache.align:]) == bound
    assert cache.get_seq_length() == 37 + steps
    assert cache.layers[0].dropped > 0
    # The pattern matters (so a wrong position or a dropped key could not pass unnoticed).
    dense = tiny(family, DilatedPattern.dense(1 << 20))
    dense.load_state_dict(model.state_dict())
    ref, _ = run(dense, ids, DynamicCache(config=dense.config), 37, 4)
    assert (ref[:, 37:] - want[:, 37:41]).abs().max() > tol * scale


@pytest.mark.parametrize("dense", [(), (1,)], ids=["sparse", "dense-kv-head"])
def test_generate_with_pattern_cache_and_chunked_prefill(dense):
    # (a dense head keeps every key: its cache is never cut, so generate() appends to keys that
    # prefill() stored under inference mode)
    pattern = DilatedPattern([6, 16], [1, 2], window="sliding", sink_tokens=1,
                             dense_kv_heads=dense)
    model = tiny("llama", pattern)
    ids = torch.randint(3, VOCAB, (2, 45))
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=0)
    ref = model.generate(ids, **kw)
    for extra in ({}, {"prefill_chunk_size": 9}):
        out = model.generate(ids, **{cache_kwarg(model): PatternCache(model)}, **extra, **kw)
        assert torch.equal(out.sequences, ref.sequences), extra
        for a, b in zip(out.logits, ref.logits):
            assert (a - b).abs().max() <= model_tol(65, 64) * b.abs().max()  # 65 keys at most
    # prefill() then generate(): generate feeds only the token the cache has not seen
    cache = prefill(model, ids[:, :-1], chunk_tokens=13)
    assert isinstance(cache, PatternCache) and cache.get_seq_length() == 44
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache},
                         **kw)
    assert torch.equal(out.sequences, ref.sequences)
    stored = max(layer.keys.shape[-2] for layer in cache.layers)
    assert stored == 64 if dense else stored <= cache.max_stored_tokens  # (dense: every key)


@pytest.mark.parametrize("dense", [(), (0,)], ids=["sparse", "dense-kv-head"])
def test_a_decode_step_appends_in_place_and_copies_no_stored_key(dense):
    # A step writes its own keys into room kept after the stored ones: the layer's keys keep
    # their storage from step to step (a copy per step would move them) and hold exactly the
    # keys a DynamicCache holds (with dense heads all of them; without, the kept tail); a
    # reorder (beam search) or a crop is followed correctly.
    pattern = DilatedPattern([8, 16], [1, 2], sink_tokens=1, dense_kv_heads=dense)
    model = tiny("llama", pattern)
    ids = torch.randint(3, VOCAB, (2, 40))
    cache, full = PatternCache(model), DynamicCache(config=model.config)
    with torch.inference_mode():
        for c in (cache, full):
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): c})
        moved, tok = 0, ids[:, -1:]
        for step in range(30):
            if step == 20:  # a beam reorder: rows swapped, in both caches
                for c in (cache, full):
                    c.reorder_cache(torch.tensor([1, 0]))
            where = cache.layers[0].keys.data_ptr()
            for c in (cache, full):
                model(input_ids=tok, use_cache=True, **{cache_kwarg(model): c})
            moved += cache.layers[0].keys.data_ptr() != where
            tok = torch.randint(3, VOCAB, (2, 1))
            for layer, ref in zip(cache.layers[:1], full.layers):  # (the first layer's keys
                # depend on the tokens only, not on how earlier attention rounded)
                first = ref.keys.shape[-2] - layer.keys.shape[-2] + pattern.sink_tokens
                for got, want in ((layer.keys, ref.keys), (layer.values, ref.values)):
                    kept = want if dense else torch.cat([want[..., :pattern.sink_tokens, :],
                                                         want[..., first:, :]], -2)
                    assert torch.equal(got, kept), step
    # moved: the first step's room, the reorder's copy and (sparse) a cut every `align` steps,
    # which writes the kept keys once, into a buffer with room
    assert moved <= (2 if dense else 2 + (30 // cache.align + 1)), moved
    if dense:  # a crop keeps the room: the next keys go after the kept ones
        cache.crop(-3)
        with torch.inference_mode():
            model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
        assert cache.layers[0].keys.shape[-2] == 40 + 30 - 3 + 1
    # decoding outside inference mode after a prefill in it (generate() after prefill()): keys
    # made under inference mode cannot be written in place there: stored anew once, then in place
    where = []
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=tok, use_cache=True, **{cache_kwarg(model): cache})
            where.append(cache.layers[0].keys.data_ptr())
            assert not cache.layers[0].keys.is_inference()
    assert where[1] == where[2], where


def test_a_pattern_cache_concatenates_where_a_gradient_is_recorded_or_compile_traces(
        monkeypatch):
    # into kept room only eagerly and without a gradient: a traced step must not read
    # addresses, and keys a backward saved must never be overwritten
    from hf_hilbert_attn.integrations.cache import PatternCacheLayer

    layer, x = PatternCacheLayer(DilatedPattern([8, 16], [1, 2]), 4), torch.randn(1, 2, 3, 8)
    with torch.inference_mode():
        layer.update(x, x)
        where = layer.keys.data_ptr()
        layer.update(x[:, :, :1], x[:, :, :1])
        assert layer.keys.data_ptr() == where  # (into the room)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        layer.update(x[:, :, :1], x[:, :, :1])
        assert layer.keys.data_ptr() != where  # (concatenated)
    monkeypatch.undo()
    y = torch.randn(1, 2, 1, 8, requires_grad=True)
    keys, _ = layer.update(y, y)
    keys[..., -1:, :].sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y)) and torch.equal(keys[..., :5, :], torch.cat(
        [x, x[:, :, :1], x[:, :, :1]], -2))


def test_a_pattern_cache_keeps_values_narrower_than_keys():
    # MLA (DeepSeek-V3's eager attention): keys 192 wide, values 128; the buffers with room are
    # each their own tensor's width, through appends, a cut and the room's regrowth
    from hf_hilbert_attn.integrations.cache import PatternCacheLayer

    layer = PatternCacheLayer(DilatedPattern([8, 16], [1, 2], sink_tokens=1), 4, align=1)
    k, v = torch.randn(1, 2, 300, 12), torch.randn(1, 2, 300, 8)
    with torch.inference_mode():
        for a, b in ((0, 20), *((t, t + 1) for t in range(20, 300))):
            keys, values = layer.update(k[:, :, a:b], v[:, :, a:b])
            kept = torch.cat([torch.arange(1), torch.arange(b - keys.shape[-2] + 1, b)])
            assert torch.equal(keys, k[:, :, kept]) and torch.equal(values, v[:, :, kept]), b
    assert layer.dropped > 0 and layer._room is not None


def test_padded_batches_and_crop_are_refused():
    model = tiny("llama", DilatedPattern([4, 8], [1, 2]))
    ids = torch.randint(3, VOCAB, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match="padded batches"):
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                       pad_token_id=0, **{cache_kwarg(model): PatternCache(model)})
    cache = prefill(model, ids)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-2)
    model.set_attn_implementation("sdpa")  # sdpa would read the dropped slots as positions
    with pytest.raises(ValueError, match="PatternCache needs attn_implementation"):
        PatternCache(model)


@pytest.mark.parametrize("trial", range(4))
def test_retention_rule_against_the_mask(trial):
    """first_needed_key: every key a later query attends (through a config) is kept, and the
    first kept key is attended; cache_reach bounds (and is) the most keys a cache keeps."""
    rng = random.Random(trial)
    for _ in range(12):
        pattern = random_pattern(rng, max_w=20, max_rate=5, window=None, sinks=None)
        heads = rng.choice([1, 2, 3, 4, 8])
        n = 3 * pattern.max_segment + 12
        pos = torch.arange(n)
        allowed = pattern.replace(sink_tokens=0).build_mask(heads, pos, pos)[0].any(0)  # [q, k]
        for p in range(2 * pattern.max_segment + 4):
            attended = allowed[p:, :p].any(0).nonzero().flatten()
            want = int(attended.min()) if attended.numel() else p
            assert pattern.first_needed_key(p, heads) == want, (pattern, heads, p)
        for align in {1, pattern.shift_period if pattern.shift_period <= pattern.max_segment
                      else 1}:
            kept = [p - pattern.first_needed_key(p, heads) // align * align
                    for p in range(4 * pattern.max_segment + 2 * align)]
            assert max(kept) == pattern.cache_reach(heads, align), (pattern, heads, align)


def test_shift_period_leaves_the_rule_unchanged():
    for pattern, per in ((DilatedPattern([4, 6], [1, 3]), 12),
                         (DilatedPattern([5, 9], [1, 2], window="sliding"), 2)):
        assert pattern.shift_period == per
        pos = torch.arange(40)
        mask = pattern.build_mask(4, pos, pos)
        assert torch.equal(mask, pattern.build_mask(4, pos + per, pos + per))
        assert not torch.equal(mask, pattern.build_mask(4, pos + 1, pos + 1))


# ----------------------------------------------------------------------------- eval
def test_eval_chunked_prefill_is_the_same_perplexity_and_passkey_answer(monkeypatch):
    from hf_hilbert_attn.tools.evaluation import passkey, perplexity
    from hf_hilbert_attn.tools.evaluation.corpus import build_char_tokenizer
    from hf_hilbert_attn.integrations import cache as cache_mod

    model = tiny("llama", DilatedPattern([8, 16], [1, 2], window="sliding", sink_tokens=1))
    ids = torch.randint(3, VOCAB, (1, 61))
    for scored in (1, 60):
        want = perplexity.window_nll(model, ids, scored, prefill_chunk=None)
        for chunk in (7, 13):
            got = perplexity.window_nll(model, ids, scored, prefill_chunk=chunk)
            # the NLL of `scored` tokens, through rows of at most 61 keys
            assert got == pytest.approx(want, rel=model_tol(scored, 61, 64)), (scored, chunk)
    # "auto": windows longer than DEFAULT_PREFILL_CHUNK run chunked, through a PatternCache
    monkeypatch.setattr(perplexity, "DEFAULT_PREFILL_CHUNK", 16)
    assert perplexity.resolve_prefill_chunk(model, 61) == 16
    assert perplexity.resolve_prefill_chunk(model, 16) is None
    sdpa = tiny("llama", DilatedPattern([8], [1]))
    sdpa.set_attn_implementation("sdpa")
    assert perplexity.resolve_prefill_chunk(sdpa, 10 ** 6) is None  # dense rows: full forward
    with pytest.raises(ValueError, match="prefill_chunk must be"):
        perplexity.resolve_prefill_chunk(model, 61, -3)
    seen = []
    real = cache_mod.PatternCache.__init__
    monkeypatch.setattr(cache_mod.PatternCache, "__init__",
                        lambda self, *a, **k: (seen.append(1), real(self, *a, **k))[1])
    tokens = torch.randint(3, VOCAB, (100,))
    res = perplexity.evaluate_perplexity(model, tokens, 60, 20)
    ref = perplexity.evaluate_perplexity(model, tokens, 60, 20, prefill_chunk=None)
    assert seen and res.nll_sum == pytest.approx(ref.nll_sum, rel=model_tol(100, 60, 64))
    # passkey: generate through a PatternCache with chunked prefill, same text as without
    tok = build_char_tokenizer()
    model = tiny("llama", DilatedPattern([8, 16], [1, 2], sink_tokens=1))
    model.resize_token_embeddings(len(tok))
    prompt = torch.randint(3, VOCAB, (1, 40))
    seen.clear()
    text = passkey.hf_generate_fn(model, tok, 4, prefill_chunk=9)(prompt)
    assert seen and text == passkey.hf_generate_fn(model, tok, 4, prefill_chunk=None)(prompt)
    prompts = passkey.passkey_prompts(tok, 130, [0.0, 1.0], 1)  # teacher forced: same verdicts
    seen.clear()
    got = passkey.passkey_teacher_forced(model, tok, prompts, prefill_chunk=50)
    assert len(seen) == 2 and got == passkey.passkey_teacher_forced(model, tok, prompts,
                                                                    prefill_chunk=None)


# ----------------------------------------------------------------------------- benchmark
def test_bench_generate_smoke(tmp_path, monkeypatch, capsys):
    import csv

    from hf_hilbert_attn.tools.cli import main
    from hf_hilbert_attn.tools.evaluation import bench_generate
    from hf_hilbert_attn.integrations import cache as cache_mod

    argv = ["bench", "generate", "--preset", "tiny", "--contexts", "40", "70", "--new-tokens",
            "2", "--prefill-chunk", "16", "--pattern", "8,16:1,2:sliding:sinks=1", "--no-warmup",
            "--device", "cpu", "--quiet", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    with open(tmp_path / "bench_generate_tiny_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["cache"], int(r["context"]), r["status"]) for r in rows] == [
        ("pattern", 40, "ok"), ("pattern", 70, "ok"), ("dynamic", 40, "ok"), ("dynamic", 70, "ok")]
    stored = {(r["cache"], int(r["context"])): int(r["stored_tokens"]) for r in rows}
    assert stored[("pattern", 40)] == stored[("pattern", 70)] == 1 + 15  # sinks + window - 1
    assert stored[("dynamic", 70)] == 70 + 2 - 1  # every key
    assert "| pattern | 70 | ok |" in (tmp_path / "bench_generate_tiny_cpu.md").read_text()

    # side by side on the same weights: SDPA, the pattern, the pattern with a dense head
    argv += ["--baselines", "sdpa", "--dense-kv-heads", "0", "--contexts", "40"]
    assert main(argv) == 0
    with open(tmp_path / "bench_generate_tiny_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    label = rows[1]["pattern"]
    assert [(r["method"], r["cache"]) for r in rows] == [
        ("sdpa", "dynamic"), (label, "pattern"), (label, "dynamic"), (label + "+kv0", "pattern"),
        (label + "+kv0", "dynamic")]
    assert all(r["status"] == "ok" and float(r["ms_per_token"]) > 0 for r in rows)
    dense = {r["cache"]: int(r["stored_tokens"]) for r in rows if r["method"].endswith("+kv0")}
    assert dense["pattern"] == dense["dynamic"] == 40 + 2 - 1  # a dense head keeps every key
    with pytest.raises(SystemExit, match="--dense-kv-heads: dense_kv_heads .2. name"):
        main(argv + ["--dense-kv-heads", "2"])  # the tiny model has 2 key/value heads

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(cache_mod, "prefill", oom)
    model = bench_generate.build_model("tiny", torch.float32, torch.device("cpu"),
                                       DilatedPattern([8], [1]))
    row = bench_generate.measure_generate(model, "dynamic", 30, 2, 16, torch.device("cpu"))
    assert row["status"] == "OOM" and row["stored_tokens"] == ""
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--preset", "tiny", "--contexts", "1m2"])
    assert "expected a length like" in capsys.readouterr().err
    # ms per token: the median step (a slow step and generate()'s setup do not move it)
    clock = bench_generate._StepClock(torch.device("cpu"))
    clock.stamps = [0.0, 0.5, 1.5, 2.5, 9.5]
    assert clock.ms_per_token() == 1000.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_over_dropped_keys_equals_the_reference(backend):
    """attend_with_dropped_keys (sinks dense + the tail in shifted natural order or at explicit
    positions, merged by lse) against reference_attention over the kept keys' true positions."""
    from hf_hilbert_attn import reference_attention
    from hf_hilbert_attn.integrations.cache import attend_with_dropped_keys

    rng = random.Random(7)
    cases = [DilatedPattern([8, 16], [1, 4], sink_tokens=2),  # tail in shifted natural order
             DilatedPattern([6, 16], [1, 4], window="sliding", sink_tokens=3),
             DilatedPattern([6, 10], [1, 3], sink_tokens=1)]  # tail at explicit positions
    for pattern in cases:
        for sq in (1, 5):
            odd = pattern.shift_period == 30  # lcm(6, 10) > 10: no alignment, any first position
            first = 16 * rng.randint(1, 3) + (rng.randint(1, 5) if odd else 0)
            n_tail = pattern.max_segment + sq - 1
            sinks = pattern.sink_tokens
            q = torch.randn(2, 4, sq, 16)
            k, v = torch.randn(2, 2, sinks + n_tail, 16), torch.randn(2, 2, sinks + n_tail, 16)
            q_start = first + n_tail - sq
            got = attend_with_dropped_keys(q, k, v, pattern, q_start=q_start,
                                           dropped=first - sinks, backend=backend)
            kpos = torch.cat([torch.arange(sinks), torch.arange(first, first + n_tail)])
            want = reference_attention(q, k, v, pattern, k_positions=kpos,
                                       q_positions=torch.arange(q_start, q_start + sq))
            # float32, both: each within the sums' bound of the exact result
            tol = 2 * attention_tol(sinks + n_tail, 16)
            assert (got - want).abs().max() < tol * max(1.0, float(want.abs().max())), (
                pattern, sq, first)


@pytest.mark.gpu
@pytest.mark.parametrize("room_bytes", [None, 0], ids=["concatenated", "kept-room"])
def test_gpu_pattern_cache_decode_matches_dynamic_cache(room_bytes, monkeypatch):
    # The Triton kernels: the tail in shifted natural order, sinks dense; bf16 model. Both
    # caches decode the same tokens (greedy bf16 runs could part ways on a near tie). A small
    # cache on a GPU concatenates (D82); with ROOM_BYTES 0 it writes into kept room.
    from hf_hilbert_attn.integrations import cache as cache_module

    if room_bytes is not None:
        monkeypatch.setattr(cache_module, "ROOM_BYTES", room_bytes)
    pattern = DilatedPattern([16, 64], [1, 4], window="sliding", sink_tokens=1)
    model = tiny("llama", pattern).cuda().to(torch.bfloat16)
    ids = torch.randint(3, VOCAB, (2, 340), device="cuda")
    logits = {}
    for kind in ("pattern", "dynamic"):
        cache = PatternCache(model) if kind == "pattern" else DynamicCache(config=model.config)
        prefill(model, ids[:, :300], chunk_tokens=96, cache=cache)
        with torch.inference_mode():
            logits[kind] = torch.cat([model(input_ids=ids[:, t:t + 1], use_cache=True,
                                            **{cache_kwarg(model): cache}).logits
                                      for t in range(300, 340)], dim=1).float()
        if kind == "pattern":
            assert max(layer.keys.shape[-2] for layer in cache.layers) <= \
                cache.max_stored_tokens < 300
            assert (cache.layers[0]._room is None) == (room_bytes is None)
    err = (logits["pattern"] - logits["dynamic"]).abs().max()
    # a bf16 model rounds its activations at every stage (2 layers and the head): ~4 eps(bf16)
    assert err <= 4 * eps("bfloat16") * logits["dynamic"].abs().max(), err
