"""Models whose layers differ in kind: a layer the config declares ``sliding_attention`` (or
every layer of a Mistral-style config with an active window) keeps exactly its window; the
full-attention layers run the dilated pattern. Tiny random models on the CPU: four families
whose configs declare their layers in the ways Transformers has (a window on every layer,
``max_window_layers``, ``layer_types``), windows the prompts cross."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers import masking_utils
from transformers.masking_utils import (and_masks, causal_mask_function, or_masks,
                                        packed_sequence_mask_function,
                                        sliding_window_causal_mask_function)

import hf_hilbert_attn
from hf_hilbert_attn import DilatedPattern, PatternCache, configure, get_pattern, reference_attention
from hf_hilbert_attn.integrations import transformers as integ
from hf_hilbert_attn.integrations.cache import cache_kwarg
from hf_hilbert_attn.integrations.model_config import layer_window
from hf_hilbert_attn.integrations.transformers_checks import mask_window
from hf_hilbert_attn.tools.cli import main as cli_main
from conftest import eps
from test_transformers import (DENSE, SMALL, VOCAB, assert_rel_close, generate_position_ids,
                               left_pad_mask, loss_logits_grads, tokens)

WINDOW = 8  # shorter than every prompt below: the window decides what a layer sees
SLIDE, FULL = "sliding_attention", "full_attention"
FAMILIES = {  # family: (config overrides, the kind of each layer)
    "mistral": (dict(), [SLIDE, SLIDE]),  # no layer_types: the window is on every layer
    "qwen2": (dict(use_sliding_window=True, max_window_layers=1), [FULL, SLIDE]),
    "ministral": (dict(layer_types=[SLIDE, FULL, SLIDE]), [SLIDE, FULL, SLIDE]),
    "gemma3_text": (dict(layer_types=[FULL, SLIDE, SLIDE]), [FULL, SLIDE, SLIDE]),
}


def tiny_config(family: str, window=WINDOW):
    overrides, kinds = FAMILIES[family]
    if window is None and "layer_types" in overrides:  # the same layers, all full attention
        overrides, window = dict(overrides, layer_types=[FULL] * len(kinds)), WINDOW
    return AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=16,
        num_hidden_layers=len(kinds), num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, sliding_window=window, **overrides)


def tiny(family: str, attn: str = "sdpa", window=WINDOW):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, window), attn_implementation=attn,
                                            dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_runs_what_its_config_declares(family, tmp_path, capsys):
    config = tiny_config(family)
    kinds = FAMILIES[family][1]
    config.hilbert_attn = SMALL.to_dict()
    window = DilatedPattern([WINDOW], [1], window="sliding")
    for i, kind in enumerate(kinds):
        assert layer_window(config, i) == (window if kind == SLIDE else None)
        assert get_pattern(config, i) == (window if kind == SLIDE else SMALL), i
    assert get_pattern(config) == SMALL and layer_window(config, None) is None
    # show-pattern MODEL_DIR names the layers that keep their window
    model = configure(tiny(family), SMALL)
    model.save_pretrained(tmp_path)
    assert cli_main(["show-pattern", str(tmp_path), "--length", "64"]) == 0
    sliding = [str(i) for i, k in enumerate(kinds) if k == SLIDE]
    assert f"window of {WINDOW} tokens; the others run the pattern): {' '.join(sliding)}  " \
           f"({len(sliding)} of {len(kinds)})" in capsys.readouterr().out
    # without an active window, every layer is full attention
    assert layer_window(tiny_config(family, window=None), 0) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_dense_pattern_every_layer_equals_sdpa(family):
    """Logits, loss and every gradient equal sdpa's, also for a left-padded batch; the windows
    matter (the same weights without them give other logits), so a layer that lost its window
    could not pass."""
    padded_as_sdpa(tiny(family), tiny(family, window=None), 40, 9)


def padded_as_sdpa(model, plain, length: int, pad: int):
    """:func:`dense_as_before` on two rows of ``length`` tokens, then a batch whose second row
    has ``pad`` left padding: its real tokens' logits equal sdpa's; and ``plain`` (the model's
    weights without its windows or chunks) gives other logits, so they matter."""
    ids = tokens(2, length)
    ref, _ = dense_as_before(model, ids)
    mask = left_pad_mask(2, length, [0, pad])
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask).logits
        plain.load_state_dict(model.state_dict())
        full = plain(ids).logits
    real = mask.bool()
    assert_rel_close(got[real], want[real], what="left-padded logits")
    assert (full - ref[1]).abs().max() > 1e-3 * ref[1].abs().max()


def dense_as_before(model, ids):
    """``(before, after)``: loss, logits and gradients of ``model`` as it was loaded, then
    configured with the dense pattern; asserts they agree (every gradient, the same ones)."""
    ref = loss_logits_grads(model, ids)
    configure(model, DENSE)
    got = loss_logits_grads(model, ids)
    assert_rel_close(got[0], ref[0], what="loss")
    assert_rel_close(got[1], ref[1], what="logits")
    assert ref[2].keys() == got[2].keys()
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], what=f"grad {name}")
    return ref, got


def logits_under(model, ids, *implementations) -> list:
    """The model's logits under each attention implementation in turn (no gradients)."""
    out = []
    with torch.no_grad():
        for implementation in implementations:
            model.set_attn_implementation(implementation)
            out.append(model(ids).logits)
    return out


def _reference_layer(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    # Each layer's pattern by the config, as the dense float32 reference: what the model must be.
    pattern = get_pattern(module.config, module.layer_idx)
    return reference_attention(query, key, value, pattern, scale=scaling).transpose(1, 2), None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sparse_pattern_runs_on_full_layers_only(family):
    """With a sparse pattern (and a calibration's dense head in a full layer), the model equals
    one whose layers run the reference attention of ``get_pattern(config, layer)``; a dense head
    in a sliding-window layer is refused in one line."""
    AttentionInterface.register("hilbert_reference_test", _reference_layer)
    model = configure(tiny(family), SMALL)
    kinds = FAMILIES[family][1]
    full = [i for i, k in enumerate(kinds) if k == FULL]
    hf_hilbert_attn.set_dense_kv_heads(model, {i: [1] for i in full})
    got, want, dense = logits_under(model, tokens(2, 40), "hilbert_dilated",
                                    "hilbert_reference_test", "sdpa")
    assert_rel_close(got, want, what="logits vs the reference")
    if full:  # the pattern matters
        assert (got - dense).abs().max() > 1e-3 * dense.abs().max()
    with pytest.raises(ValueError, match=r"layer \d: a sliding-window or chunked layer keeps") as e:
        hf_hilbert_attn.set_dense_kv_heads(model, {kinds.index(SLIDE): [0]})
    assert "\n" not in str(e.value)


def generates_as_sdpa(model, length: int, pads: list, cache: str, new: int):
    """Greedy generation of ``new`` tokens after 3 rows of ``length`` gives sdpa's tokens and
    logits: rows left-padded by ``pads`` with Transformers' ``cache`` ("dynamic", "static"),
    unpadded with a PatternCache ("pattern"), whose layers are returned (else None)."""
    ids = tokens(3, length)
    mask = torch.ones_like(ids) if cache == "pattern" else left_pad_mask(3, length, pads)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    theirs = {} if cache == "pattern" else dict(cache_implementation=cache)
    ours = {cache_kwarg(model): PatternCache(model)} if cache == "pattern" else theirs
    got = model.generate(ids, **ours, **kw)
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, **theirs, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for t, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert_rel_close(a, b, what=f"step {t}")
    return ours[cache_kwarg(model)].layers if cache == "pattern" else None


@pytest.mark.parametrize("cache", ["dynamic", "static", "pattern"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_keeps_the_window(family, cache):
    """Greedy generation past the window gives sdpa's tokens and logits: left-padded rows with
    Transformers' caches (a sliding layer's cache holds its last keys only), unpadded rows with a
    PatternCache, whose sliding layers store fewer keys than the window."""
    stored = generates_as_sdpa(configure(tiny(family), DENSE), 21, [0, 4, 9], cache, 3 * WINDOW)
    if cache == "pattern":
        kinds = FAMILIES[family][1]
        assert [layer.is_sliding for layer in stored] == [k == SLIDE for k in kinds]
        assert all(layer.keys.shape[-2] < WINDOW for layer, k in zip(stored, kinds) if k == SLIDE)


def test_a_window_the_config_does_not_declare_is_refused():
    """A layer whose mask or ``sliding_window`` argument applies another window than its config
    declares is refused in one line, never run with the wrong one."""
    model = configure(tiny("qwen2"), SMALL)  # layer 0 full, layer 1 sliding
    q, kv = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16)
    attn = [layer.self_attn for layer in model.model.layers]
    full, windowed = integ.hilbert_dilated_mask(1, 12, 12), integ.hilbert_dilated_mask(
        1, 12, 12, mask_function=sliding_window_causal_mask_function(WINDOW))
    assert (full.window, windowed.window) == (None, get_pattern(model.config, 1))
    integ.hilbert_dilated_attention_forward(attn[1], q, kv, kv, windowed, sliding_window=WINDOW)
    for layer, info, kw in [(attn[0], full, dict(sliding_window=5)), (attn[0], windowed, {}),
                            (attn[1], full, {}), (attn[1], windowed, dict(sliding_window=5))]:
        with pytest.raises(ValueError, match=r"layer \d applies .* but its config declares") as e:
            integ.hilbert_dilated_attention_forward(layer, q, kv, kv, info, **kw)
        assert "\n" not in str(e.value)


def test_mask_functions_name_their_window():
    """The window is read from Transformers' own mask function, under the packed-sequence
    wrappers too; a union or two windows are refused."""
    sliding = sliding_window_causal_mask_function(6)
    assert mask_window(None) is None and mask_window(causal_mask_function) is None
    assert mask_window(sliding) == DilatedPattern([6], [1], window="sliding")
    # a window of 0 allows no key: Transformers 5.17 builds one for Qwen2-MoE's sliding layer
    # type, which no layer of a model with its window off has (such a model runs: model zoo)
    assert mask_window(sliding_window_causal_mask_function(0)) is None
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)  # (5.2x)
    packed = sliding if remap is None else remap(sliding, torch.zeros(1, 4, dtype=torch.long))
    assert mask_window(and_masks(packed, packed_sequence_mask_function(
        torch.zeros(1, 4, dtype=torch.long)))) == mask_window(sliding)
    for bad in (or_masks(sliding, causal_mask_function),
                and_masks(sliding, sliding_window_causal_mask_function(4))):
        with pytest.raises(ValueError, match="cannot apply the mask function"):
            mask_window(bad)


def test_a_sliding_layers_cache_offset_counts_slots_from_its_first_key():
    """Transformers' sliding cache layer keeps the last keys and says where they start
    (``kv_offset``): the mask counts slots from there, padding included, so the layer sees the
    same relative positions as with every key."""
    mask = left_pad_mask(2, 30, [0, 5])
    fn = sliding_window_causal_mask_function(WINDOW)
    info = integ.hilbert_dilated_mask(2, 1, WINDOW, q_offset=29, kv_offset=29 - WINDOW + 1,
                                      mask_function=fn, attention_mask=mask)
    assert (info.q_offset, info.kv_offset, info.kv_length) == (WINDOW - 1, 0, WINDOW)
    assert info.padding_mask is None  # the kept keys are real in both rows
    mask[1, :25] = 0
    info = integ.hilbert_dilated_mask(2, 1, WINDOW, q_offset=29, kv_offset=29 - WINDOW + 1,
                                      mask_function=fn, attention_mask=mask)
    assert info.padding_mask.tolist()[1] == [False] * 3 + [True] * 5


@pytest.mark.gpu
# the dynamic and pattern caches on one worker (they compile the same kernels), apart from the
# other Transformers tests: all together they were the GPU suite's longest unit (124 of 142 s
# cold); the static cache a unit of its own (Inductor compiles its step: 69 s of 117 cold, 89 s
# in session 49's cold suite with three compiles)
@pytest.mark.parametrize("cache", [
    pytest.param("dynamic", marks=pytest.mark.xdist_group("gpu_layer_types")),
    pytest.param("static", marks=pytest.mark.xdist_group("gpu_layer_types_static")),
    pytest.param("pattern", marks=pytest.mark.xdist_group("gpu_layer_types"))])
def test_gpu_mixed_layers_generate_as_the_full_forward(cache):
    """On the GPU (the kernels run the window and the sparse pattern, the decode kernel the
    steps): every step's logits equal a full forward of the generated sequence, and with the
    dense pattern the tokens are sdpa's."""
    model = configure(tiny("gemma3_text"), SMALL).cuda()
    new = 2 * WINDOW
    ids = tokens(2, 41).cuda()
    mask = torch.ones_like(ids) if cache == "pattern" else left_pad_mask(2, 41, [0, 5]).cuda()
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    ours = {cache_kwarg(model): PatternCache(model)} if cache == "pattern" else dict(
        cache_implementation=cache)
    out = model.generate(ids, **ours, **kw, output_logits=True, return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new])], dim=1)
    full = model(out.sequences, attention_mask=full_mask,
                 position_ids=generate_position_ids(full_mask)).logits
    for t, step_logits in enumerate(out.logits):
        # Triton may use TF32 for float32 dots: a rounding of each input (eps(tf32)/2) per dot,
        # through ~6 dots per logit (conftest.EPS)
        assert_rel_close(step_logits, full[:, 41 + t - 1], rel=10 * eps("tf32"), what=f"step {t}")
    # the dense pattern's tokens against sdpa's without compiling (a static cache's generate()
    # would compile both anew: two of this test's three Inductor compiles; the compiled dense
    # route against sdpa's: test_transformers' static case)
    configure(model, DENSE)
    theirs = {} if cache == "pattern" else dict(cache_implementation=cache)
    ours = {cache_kwarg(model): PatternCache(model)} if cache == "pattern" else theirs
    dense = model.generate(ids, **ours, **kw, disable_compile=True)
    model.set_attn_implementation("sdpa")
    assert torch.equal(dense, model.generate(ids, **theirs, **kw, disable_compile=True))


def test_mixed_layers_example_builds_a_model_that_keeps_its_windows(tmp_path, capsys):
    """``examples/mixed_layers.py``: a Llama checkpoint as a Ministral model with every 3rd layer
    full and an 8-token window elsewhere; within one window the source model's logits, beyond it
    other logits, and ``hilbert_dilated`` with the dense pattern equals its sdpa."""
    import importlib.util
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location(
        "example_mixed_layers", Path(__file__).resolve().parents[1] / "examples" / "mixed_layers.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512, tie_word_embeddings=True)
                     ).save_pretrained(tmp_path / "llama")
    assert example.main([str(tmp_path / "llama"), str(tmp_path / "mixed"), "--window", "8",
                         "--every", "3"]) == 0
    assert "full attention in [2, 5], the others a 8-token window" in capsys.readouterr().out
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    mixed = AutoModelForCausalLM.from_pretrained(tmp_path / "mixed").eval()
    assert mixed.config.layer_types == [SLIDE, SLIDE, FULL] * 2
    ids = tokens(1, 30)
    with torch.no_grad():
        want, got = source(ids).logits, mixed(ids).logits
        assert_rel_close(got[:, :8], want[:, :8], what="within the window")
        assert (got - want).abs().max() > 1e-3 * want.abs().max()
        assert_rel_close(configure(mixed, DENSE)(ids).logits, got, what="hilbert_dilated")
    with pytest.raises(SystemExit):
        example.main([str(tmp_path / "llama"), str(tmp_path / "x"), "--window", "0"])
