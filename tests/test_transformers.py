"""attn_implementation="hilbert_dilated" in real (tiny, random) Transformers models.

Families: Llama (GQA), Qwen2, Mistral, GPT-2; float32, hidden 64, 2 layers, 4 heads, vocab 128.
Dense equivalence uses hf_hilbert_attn/patterns/dense.yaml against sdpa; everything else compares our own runs
(packed vs separate, cached vs full forward, hilbert vs natural, checkpointed vs not) with a
small non-dense pattern whose segments are shorter than the sequences, so positions matter.
"""

import copy
import dataclasses
import importlib
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.models.auto.configuration_auto import model_type_to_module_name

import hf_hilbert_attn
from conftest import eps, model_tol
from hf_hilbert_attn import DilatedPattern, configure
from hf_hilbert_attn.integrations import model_config
from hf_hilbert_attn.integrations import transformers as integ

CONFIGS = Path(__file__).resolve().parents[1] / "hf_hilbert_attn" / "patterns"
DENSE = CONFIGS / "dense.yaml"
# Segments shorter than the prompts: a wrong key position changes segment / class membership.
SMALL = DilatedPattern([8, 16, 32], [1, 2, 4])
FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]
VOCAB = 128


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, **common)
    else:
        llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          attention_dropout=0.0, **common)
        if family == "llama":
            cfg = LlamaConfig(**llama_like)
        elif family == "qwen2":
            cfg = Qwen2Config(use_sliding_window=False, **llama_like)
        elif family == "mistral":
            cfg = MistralConfig(sliding_window=None, **llama_like)
        else:
            raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, attn: str = "sdpa", **overrides):
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides),
                                             attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def tokens(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))  # no pad / bos / eos ids


def left_pad_mask(batch: int, length: int, pads) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    return mask


def generate_position_ids(mask: torch.Tensor) -> torch.Tensor:
    # What generate() computes for a left-padded batch.
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def loss_logits_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=kw.pop("labels", ids), **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


# Two runs of one tiny model's function through other sums (our attention vs SDPA, packed vs
# separate, cached decode vs full): <= 2 x 64 tokens, rows of <= 64 keys, 128 features
# (conftest.model_tol), relative to the tensor's largest entry
MODEL_REL = model_tol(2 * 64, 64, 128)


def assert_rel_close(actual, expected, rel=MODEL_REL, what=""):
    # Relative to the tensor's scale: elementwise rtol is meaningless for entries near 0.
    scale = expected.abs().max().clamp_min(1e-12)
    err = (actual - expected).abs().max()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * max |ref| {scale:.3g}"


# ------------------------------------------------------------------------------ registration
def test_register_is_idempotent_and_on_import():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    hf_hilbert_attn.register()
    hf_hilbert_attn.register()
    assert AttentionInterface._global_mapping["hilbert_dilated"] is integ.hilbert_dilated_attention_forward
    assert AttentionMaskInterface._global_mapping["hilbert_dilated"] is integ.hilbert_dilated_mask
    assert "hilbert_dilated" in AttentionInterface().valid_keys()


def test_default_pattern_matches_yaml():
    assert yaml.safe_load((CONFIGS / "default.yaml").read_text()) == integ.DEFAULT_PATTERN
    model = tiny_model("llama", "hilbert_dilated")
    assert getattr(model.config, "hilbert_attn", None) is None
    # a model without a pattern says once what the default costs, and how to choose
    model_config.reset_notes()
    with pytest.warns(UserWarning, match="has no 'hilbert_attn' pattern.*configure"):
        assert integ.get_pattern(model.config) == DilatedPattern.from_yaml(CONFIGS / "default.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integ.get_pattern(model.config)  # once per process, not per layer
    hf_hilbert_attn.configure(model, CONFIGS / "dense.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integ.get_pattern(model.config)  # a chosen pattern: no note


def test_mask_is_compact():
    # The mask function never builds [B, 1, Sq, Sk]: at most the 2-D padding mask.
    mask = torch.ones(2, 3000, dtype=torch.bool)
    mask[0, :7] = False
    info = integ.hilbert_dilated_mask(2, 3000, 3000, attention_mask=mask,
                                      mask_function=__import__("transformers").masking_utils.causal_mask_function)
    assert isinstance(info, integ.DilatedMaskInfo)
    assert info.padding_mask.shape == (2, 3000)
    assert integ.hilbert_dilated_mask(2, 3000, 3000, attention_mask=torch.ones(2, 3000)).padding_mask is None


# ----------------------------------------------------------------------- dense equivalence
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_matches_sdpa_logits_loss_grads(family):
    model = tiny_model(family)
    ids = tokens(2, 45)
    ref = loss_logits_grads(model, ids)
    configure(model, DENSE)
    assert model.config._attn_implementation == "hilbert_dilated"
    got = loss_logits_grads(model, ids)
    assert_rel_close(got[0], ref[0], what="loss")
    assert_rel_close(got[1], ref[1], what="logits")
    assert ref[2].keys() == got[2].keys() and len(ref[2]) == len(list(model.parameters()))
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], what=f"grad {name}")


def test_autocast_mixed_precision_matches_sdpa():
    # accelerate's mixed_precision="bf16" = torch.autocast: Llama's RoPE leaves q, k in float32
    # next to a bf16 v; the attention runs in bf16 like SDPA does (this used to raise)
    model = tiny_model("llama")
    ids = tokens(2, 45)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_logits_grads(model, ids)
    configure(model, DENSE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_logits_grads(model, ids)
    # both in bf16: the difference is bf16 rounding of two summation orders. Autocast rounds
    # every matmul's inputs and output to bf16 (half an eps each): the loss, a mean of one-sign
    # terms, keeps ~2.5 eps(bf16) of it; logits go through ~6 such roundings (2 layers of
    # attention and MLP, the head), the gradients back through twice as many
    bf16 = eps("bfloat16")
    assert_rel_close(got[0], ref[0], rel=2.5 * bf16, what="loss")
    assert_rel_close(got[1], ref[1], rel=6.5 * bf16, what="logits")
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], rel=13 * bf16, what=f"grad {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_matches_sdpa_left_padding(family):
    model = tiny_model(family)
    ids = tokens(3, 30)
    mask = left_pad_mask(3, 30, [0, 5, 11])
    labels = ids.masked_fill(mask == 0, -100)
    for pos in (None, generate_position_ids(mask)):
        ref = model(ids, attention_mask=mask, position_ids=pos, labels=labels)
        model.set_attn_implementation("hilbert_dilated")
        configure(model, DENSE, set_attn_implementation=False)
        got = model(ids, attention_mask=mask, position_ids=pos, labels=labels)
        model.set_attn_implementation("sdpa")
        real = mask.bool()
        assert torch.isfinite(got.logits).all()
        assert_rel_close(got.logits[real], ref.logits[real], what="logits of real tokens")
        assert_rel_close(got.loss, ref.loss, what="loss")


def test_dense_matches_sdpa_encoder_non_causal():
    # Non-causal (encoder) self-attention is supported: causal=False in the op.
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     vocab_size=VOCAB, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    ids = tokens(2, 29)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # right padding, as tokenizers do for encoders
    model.set_attn_implementation("sdpa")
    ref = model(ids, attention_mask=mask).last_hidden_state
    configure(model, DENSE)
    got = model(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert_rel_close(got[real], ref[real], what="encoder hidden states")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dense_generate_identical_tokens(family, cache):
    model = tiny_model(family)
    ids = tokens(3, 21)
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, cache_implementation=cache)
    for mask in (torch.ones_like(ids), left_pad_mask(3, 21, [0, 4, 9])):
        model.set_attn_implementation("sdpa")
        ref = model.generate(ids, attention_mask=mask, **kw)
        configure(model, DENSE)
        got = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got, ref), f"{family}/{cache}: tokens differ\n{ref}\n{got}"


# ------------------------------------------------------------------------ packed sequences
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_sequences_equal_separate_documents(family):
    model = configure(tiny_model(family), SMALL)
    lengths = [19, 40, 7]
    docs = [tokens(1, n) for n in lengths]
    packed = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    got = model(packed, position_ids=position_ids).logits[0]
    ref = torch.cat([model(d).logits[0] for d in docs])
    assert_rel_close(got, ref, what="packed vs separate logits")
    # The restarts matter: without them the documents would see each other.
    unpacked = model(packed).logits[0]
    assert (unpacked[lengths[0]:] - ref[lengths[0]:]).abs().max() > 1e-3


def test_packed_doc_ids_kwarg_overrides_restarts():
    model = configure(tiny_model("llama"), SMALL)
    a, b = tokens(1, 20), tokens(1, 12)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 20 + [1] * 12])
    position_ids = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0)
    got = model(packed, position_ids=position_ids, hilbert_doc_ids=doc_ids).logits[0]
    ref = torch.cat([model(a).logits[0], model(b).logits[0]])
    assert_rel_close(got, ref, what="explicit doc ids")


def test_packed_flash_kwargs_cu_seqlens():
    # DataCollatorWithFlattening(return_flash_attn_kwargs=True) sends cu_seq_lens_q/k as well.
    model = configure(tiny_model("llama"), SMALL)
    a, b = tokens(1, 21), tokens(1, 13)
    cu = torch.tensor([0, 21, 34], dtype=torch.int32)
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(21), torch.arange(13)]).unsqueeze(0)
    got = model(packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=21, max_length_k=21).logits[0]
    ref = torch.cat([model(a).logits[0], model(b).logits[0]])
    assert_rel_close(got, ref, what="cu_seqlens packing")


# --------------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family,options", [
    ("llama", {}), ("gpt2", {}),
    # sinks are the first *real* tokens of each (left-padded) row; windows slide with decoding
    ("llama", dict(window="sliding", sink_tokens=2)), ("gpt2", dict(sink_tokens=1)),
])
def test_cached_generate_matches_full_forward(family, options, cache):
    model = configure(tiny_model(family), SMALL.replace(**options))
    prompt_len, new = 41, 9  # longer than every segment; decoding crosses segment boundaries
    ids = tokens(3, prompt_len)
    mask = left_pad_mask(3, prompt_len, [0, 3, 10])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, cache_implementation=cache,
                         output_logits=True, return_dict_in_generate=True)
    seq = out.sequences
    assert len(out.logits) == new
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1)
    full = model(seq, attention_mask=full_mask, position_ids=generate_position_ids(full_mask)).logits
    for t, step_logits in enumerate(out.logits):
        assert_rel_close(step_logits, full[:, prompt_len + t - 1], what=f"step {t}")
    # The pattern matters here (so wrong key positions could not pass unnoticed).
    dense = copy.deepcopy(model)
    configure(dense, DENSE)
    dense_full = dense(seq, attention_mask=full_mask, position_ids=generate_position_ids(full_mask)).logits
    assert (dense_full[:, prompt_len:] - full[:, prompt_len:]).abs().max() > 1e-3


def test_cached_forward_without_padding_matches_full_forward():
    # Manual prefill + decode with a DynamicCache, no attention mask at all.
    from transformers import DynamicCache

    model = configure(tiny_model("llama"), SMALL)
    ids = tokens(2, 50)
    full = model(ids).logits
    cache = DynamicCache(config=model.config)
    # past_key_values: the 5.17 name, still accepted (deprecated) by 5.24, which calls it cache.
    step = model(ids[:, :35], past_key_values=cache, use_cache=True)
    assert_rel_close(step.logits, full[:, :35], what="prefill")
    for t in range(35, 44):
        step = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        assert_rel_close(step.logits[:, 0], full[:, t], what=f"decode {t}")
    # Several queries at once on top of a cache (chunked prefill, speculative decoding).
    step = model(ids[:, 44:50], past_key_values=cache, use_cache=True)
    assert_rel_close(step.logits, full[:, 44:50], what="chunk 44:50")


# ------------------------------------------------------------------------- hilbert ordering
def test_hilbert_ordering_same_logits_and_grads(monkeypatch):
    from hf_hilbert_attn import ops

    calls = []
    real = ops.hilbert_permutation

    def spy(seq_len, pattern, device=None):
        calls.append(seq_len)
        return real(seq_len, pattern, device)

    monkeypatch.setattr(ops, "hilbert_permutation", spy)
    ops._PREPARED.clear()  # (a prepared call keeps its permutation)
    model = configure(tiny_model("llama"), SMALL)
    ids = tokens(2, 53)
    ref = loss_logits_grads(model, ids)
    assert calls == []
    configure(model, SMALL.replace(ordering="hilbert"))
    got = loss_logits_grads(model, ids)
    assert calls and set(calls) == {53}, "the Hilbert layout was not used"
    assert_rel_close(got[1], ref[1], what="logits")
    assert_rel_close(got[0], ref[0], what="loss")
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], what=f"grad {name}")
    # Decoding with a cache uses natural order (positions are not 0..S-1) and still agrees.
    calls.clear()
    ops._PREPARED.clear()
    gen = model.generate(ids[:, :40], max_new_tokens=3, do_sample=False, pad_token_id=0)
    configure(model, SMALL)
    assert torch.equal(gen, model.generate(ids[:, :40], max_new_tokens=3, do_sample=False, pad_token_id=0))
    assert set(calls) == {40}  # prefill only


# ------------------------------------------------------------- training / switching / config
def test_gradient_checkpointing_matches():
    model = configure(tiny_model("llama"), SMALL)
    model.train()
    ids = tokens(2, 37)
    ref = loss_logits_grads(model, ids)
    # activation_checkpointing_enable is the newer name (5.2x); 5.17 has only the old one.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    got = loss_logits_grads(model, ids)
    assert_rel_close(got[0], ref[0], what="loss")
    for name in ref[2]:
        assert_rel_close(got[2][name], ref[2][name], what=f"grad {name}")


def test_set_attn_implementation_switching():
    model = tiny_model("qwen2")
    ids = tokens(2, 40)
    sdpa = model(ids).logits
    configure(model, SMALL)
    dilated = model(ids).logits
    assert (dilated - sdpa).abs().max() > 1e-3  # the pattern is really in use
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(ids).logits, sdpa)
    model.set_attn_implementation("hilbert_dilated")
    assert torch.equal(model(ids).logits, dilated)


def test_config_round_trip(tmp_path):
    pattern = DilatedPattern([8, 16, 32], [1, 2, 4], query_dilation="all")
    model = configure(tiny_model("llama"), pattern)
    ids = tokens(1, 45)
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["hilbert_attn"] == pattern.to_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hilbert_dilated").eval()
    assert loaded.config._attn_implementation == "hilbert_dilated"
    assert integ.get_pattern(loaded.config) == pattern
    assert torch.equal(loaded(ids).logits, ref)


def test_loaded_without_attn_implementation_runs_sdpa_and_prefill_says_so(tmp_path):
    # Transformers does not save the attention implementation: a model saved with hilbert_dilated
    # comes back as sdpa, and keeps running it (the user's choice at load time). Registering
    # touches no other implementation's function (D36), so its forward says nothing; our own
    # entry point, prefill, says once that the pattern is not used.
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from hf_hilbert_attn.integrations.cache import prefill

    hf_hilbert_attn.register()
    for mapping in (AttentionMaskInterface._global_mapping, AttentionMaskInterface()):
        assert mapping["sdpa"] is sdpa_mask
    model = configure(tiny_model("llama"), SMALL)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config._attn_implementation == "sdpa"
    model_config.reset_notes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded(tokens(1, 20))
    with pytest.warns(UserWarning, match="has a 'hilbert_attn' pattern but the model runs sdpa"):
        prefill(loaded, tokens(1, 20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefill(loaded, tokens(1, 20))  # once per process
        prefill(tiny_model("llama"), tokens(1, 20))  # no pattern: nothing to say


def test_configure_accepts_shipped_names():
    model = configure(tiny_model("llama"), "longnet_lm")
    assert integ.get_pattern(model.config) == hf_hilbert_attn.patterns.load("longnet_lm")
    assert integ.get_pattern(model.config) == DilatedPattern.from_yaml(CONFIGS / "longnet_lm.yaml")
    with pytest.raises(ValueError, match=r"unknown pattern 'no_such': .*shipped pattern name \[.*'dense'"):
        configure(model, "no_such")


def test_configure_accepts_dict_and_yaml(tmp_path):
    model = tiny_model("llama")
    configure(model, SMALL.to_dict(), set_attn_implementation=False)
    assert model.config._attn_implementation == "sdpa"
    assert integ.get_pattern(model.config) == SMALL
    path = tmp_path / "p.yaml"
    SMALL.replace(query_dilation="all").to_yaml(path)
    configure(model, path)
    assert model.config.hilbert_attn["query_dilation"] == "all"
    assert model.config._attn_implementation == "hilbert_dilated"


# Families whose layers compute attention in classes of their own (no ALL_ATTENTION_FUNCTIONS in
# their modeling module, what configure checks) in Transformers 5.17, 5.24 and 5.25, but Falcon,
# which calls the attention interface from 5.25 on: the refusal is tested on the first of them
# the installed release keeps so.
OWN_ATTENTION = ("falcon", "bloom", "mpt", "xglm")
FAMILY_SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def _calls_attention_interface(family: str) -> bool:
    name = model_type_to_module_name(family)
    return hasattr(importlib.import_module(f"transformers.models.{name}.modeling_{name}"),
                   "ALL_ATTENTION_FUNCTIONS")


def _own_attention_family() -> str:
    """The first of ``OWN_ATTENTION`` whose layers keep their own attention in the installed
    release (the test skips where none does)."""
    own = [f for f in OWN_ATTENTION if not _calls_attention_interface(f)]
    if not own:
        pytest.skip(f"every family of {OWN_ATTENTION} calls the attention interface in "
                    f"transformers {transformers.__version__}: name one that does not")
    return own[0]


def test_a_model_with_attention_classes_of_its_own_is_refused():
    """A family whose layers never call the attention interface: switching it would leave its
    own attention running, so ``configure`` refuses it in one line (a Llama of the same sizes is
    switched)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(_own_attention_family(),
                                                                  **FAMILY_SIZES),
                                             attn_implementation="eager")
    with pytest.raises(ValueError, match=f"{type(model).__name__} computes attention in classes"):
        hf_hilbert_attn.configure(model, SMALL)
    assert model.config._attn_implementation == "eager"
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **FAMILY_SIZES))
    assert hf_hilbert_attn.configure(llama, SMALL).config._attn_implementation == "hilbert_dilated"


def test_a_model_with_attention_classes_of_its_own_made_for_us_fails_in_one_line(tmp_path):
    """The same family made with ``attn_implementation="hilbert_dilated"`` (``from_config`` or
    ``from_pretrained``, no ``configure``): its first forward raises configure's one-line
    ``ValueError`` from the mask function, naming the model, not a TypeError or MaskReadError
    from deep inside its own attention."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(_own_attention_family(),
                                                                  **FAMILY_SIZES),
                                             attn_implementation="hilbert_dilated")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hilbert_dilated")
    for m in (model, loaded):
        with pytest.raises(ValueError, match="computes attention in classes of its own") as err:
            m(tokens(1, 8))
        assert type(err.value) is ValueError and "\n" not in str(err.value)
        assert str(err.value).startswith(f"{type(m.base_model).__name__} computes attention")


def test_falcon_through_the_attention_interface_runs_the_pattern():
    """Falcon from Transformers 5.25 (its layers call the attention interface): switched, each
    layer runs ours, not its own attention. The dense pattern gives sdpa's logits, a sparse
    pattern others (its own attention would give sdpa's whatever the pattern)."""
    if not _calls_attention_interface("falcon"):
        pytest.skip(f"Falcon has attention classes of its own in transformers "
                    f"{transformers.__version__} (refused: the test above)")
    torch.manual_seed(0)
    falcon = AutoModelForCausalLM.from_config(AutoConfig.for_model("falcon", **FAMILY_SIZES),
                                              attn_implementation="sdpa").eval()
    ids, tol = tokens(1, 40), model_tol(40, 40, 64)  # 40 tokens, rows of <= 40 keys, 64 features
    with torch.no_grad():
        want = falcon(ids).logits
        dense = configure(falcon, DENSE)(ids).logits
        sparse = configure(falcon, SMALL)(ids).logits
    assert falcon.config._attn_implementation == "hilbert_dilated"
    assert (dense - want).abs().max() <= tol * want.abs().max()
    assert (sparse - want).abs().max() > 100 * tol * want.abs().max()


# ------------------------------------------------------------------------------- sequence parallel
def test_sequence_parallel_calls_ring_with_shard_positions(monkeypatch):
    # The ring and Ulysses are tested elsewhere; here: the wiring (positions of the local
    # shard, the pattern, causality, the context's mode) and that a KV cache is refused.
    seen = []

    def fake_ring(q, k, v, pattern, *, group, mode, q_positions, k_positions, causal=True,
                  scale=None, q_doc_ids=None, k_doc_ids=None, return_lse=False, softcap=None):
        assert mode == "auto"  # the default of sequence_parallel(group)
        seen.append((group, q_positions.clone(), causal, pattern))
        return hf_hilbert_attn.dilated_attention(q, k, v, pattern, causal=causal, scale=scale,
                                                 q_positions=q_positions, k_positions=k_positions,
                                                 q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                                                 softcap=softcap)

    monkeypatch.setattr(integ._ring, "get_sequence_parallel_group", lambda: "GROUP")
    monkeypatch.setattr(integ._ring, "sequence_parallel_attention", fake_ring)
    model = configure(tiny_model("llama"), SMALL)
    ids = tokens(1, 24)
    shard_pos = torch.arange(100, 124).unsqueeze(0)
    model(ids, position_ids=shard_pos)
    assert len(seen) == 2 and all(g == "GROUP" and c for g, _, c, _ in seen)
    assert torch.equal(seen[0][1], shard_pos) and seen[0][3] == SMALL
    with pytest.raises(ValueError, match="KV cache"):  # a decode step, whatever token comes
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    zigzag_packed = torch.cat([torch.arange(12), torch.arange(12)]).unsqueeze(0)
    with pytest.raises(ValueError, match="hilbert_doc_ids"):
        model(ids, position_ids=zigzag_packed)


# ---------------------------------------------------------------------------- unsupported
def test_attention_dropout_in_training_raises():
    model = configure(tiny_model("llama", attention_dropout=0.1), DENSE)
    ids = tokens(1, 10)
    model(ids)  # eval: dropout is 0, fine
    model.train()
    with pytest.raises(ValueError, match=r"attention dropout \(got dropout=0.1"):
        model(ids)
    gpt2 = configure(tiny_model("gpt2", attn_pdrop=0.1), DENSE).train()
    with pytest.raises(ValueError, match="attn_pdrop for GPT-2"):
        gpt2(ids)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_output_attentions_raises(family):
    model = configure(tiny_model(family), DENSE)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(tokens(1, 10), output_attentions=True)


def test_a_model_reading_the_mask_as_a_tensor_is_refused_in_one_line():
    """Some models index the attention mask or read its dtype outside attention (sparse-attention
    indexers: DeepSeek-V3.2, GLM-DSA): the compact mask says so in one line instead of a raw
    TypeError, and stays an AttributeError for ``getattr(mask, name, default)``."""
    info = integ.hilbert_dilated_mask(1, 8, 8)
    assert isinstance(info, integ.DilatedMaskInfo)
    with pytest.raises(ValueError, match=r"reads the attention mask as a tensor \(mask\[\.\.\.\]\)"
                                         r".*use sdpa for this model") as err:
        info[:, 0]
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"\(mask\.dtype\)"):
        info.dtype
    assert getattr(info, "shape", None) is None and not hasattr(info, "device")
    assert info.ndim == 4 and dataclasses.replace(info, kv_offset=3).kv_offset == 3


def test_four_d_mask_raises():
    model = configure(tiny_model("llama"), DENSE)
    ids = tokens(1, 10)
    mask4 = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"precomputed attention mask of shape \(1, 1, 10, 10\)"):
        model(ids, attention_mask=mask4)


def test_cross_attention_raises():
    model = AutoModelForCausalLM.from_config(tiny_config("gpt2", add_cross_attention=True),
                                             attn_implementation="hilbert_dilated").eval()
    configure(model, DENSE)
    ids = tokens(1, 10)
    with pytest.raises(ValueError, match="not cross-attention"):
        model(ids, encoder_hidden_states=torch.randn(1, 7, 64))
    # Bart-style decoder cross-attention, even with as many keys as queries.
    from transformers import BartConfig, BartForConditionalGeneration

    bart = BartForConditionalGeneration(BartConfig(
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)).eval()
    configure(bart, DENSE)
    with pytest.raises(ValueError, match=r"not cross-attention \(queries 10 vs keys 10"):
        bart(input_ids=ids, decoder_input_ids=ids)


def test_paged_attention_raises():
    # Continuous batching hands the layer varlen kwargs over a paged cache.
    model = configure(tiny_model("llama"), DENSE)
    attn = model.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 40, 16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="paged / continuous-batching"):
        integ.hilbert_dilated_attention_forward(attn, q, kv, kv, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_custom_mask_function_raises():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks

    def image_block(b, h, q, kv):
        return q // 4 == kv // 4

    with pytest.raises(ValueError, match="image_block"):
        integ.hilbert_dilated_mask(1, 8, 8, mask_function=or_masks(causal_mask_function, image_block))
    with pytest.raises(ValueError, match="image_block"):
        integ.hilbert_dilated_mask(1, 8, 8, mask_function=and_masks(causal_mask_function, image_block))


def test_bad_patterns_raise():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="dilation_rates must contain a 1"):
        configure(model, {"segment_lengths": [8, 16], "dilation_rates": [2, 4]})
    with pytest.raises(TypeError, match="pattern must be a DilatedPattern, a dict, a YAML path"):
        configure(model, 42)
    with pytest.raises(FileNotFoundError, match="no_such.yaml"):
        configure(model, "no_such.yaml")
    model.config.hilbert_attn = [8, 1]
    model.set_attn_implementation("hilbert_dilated")
    with pytest.raises(TypeError, match=r"config.hilbert_attn must be a dict"):
        model(tokens(1, 5))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
# dynamic: with the other Transformers tests (one worker compiles the kernels they use);
# static: generate() compiles the forward (Inductor, most of its time): a unit of its own
@pytest.mark.parametrize("cache", [
    pytest.param("dynamic", marks=pytest.mark.xdist_group("gpu_transformers")),
    pytest.param("static", marks=pytest.mark.xdist_group("gpu_transformers_static"))])
def test_gpu_cached_generate_matches_full_forward(cache):
    model = configure(tiny_model("llama"), SMALL).cuda()
    prompt_len, new = 41, 6
    ids = tokens(2, prompt_len).cuda()
    mask = left_pad_mask(2, prompt_len, [0, 5]).cuda()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, cache_implementation=cache,
                         output_logits=True, return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new])], dim=1)
    full = model(out.sequences, attention_mask=full_mask,
                 position_ids=generate_position_ids(full_mask)).logits
    for t, step_logits in enumerate(out.logits):
        # Triton may use TF32 for float32 dots: a rounding of each input (eps(tf32)/2) per dot,
        # through ~6 dots per logit (conftest.EPS)
        assert_rel_close(step_logits, full[:, prompt_len + t - 1], rel=10 * eps("tf32"),
                         what=f"step {t}")
    configure(model, DENSE)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           pad_token_id=0, cache_implementation=cache)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         pad_token_id=0, cache_implementation=cache)
    assert torch.equal(dense, ref)


@pytest.mark.parametrize("hooked", [False, True], ids=["alone", "positions_given"])
def test_compiled_layer_breaks_at_most_at_the_position_call(monkeypatch, hooked):
    """Through the kernels' custom op (Triton interpreter here), a compiled decoder layer breaks
    only at the one opaque call that reads positions and documents (data-dependent checks): not
    at the attention-output collector, not inside the position checks; handed its positions by
    the model's hook (``hilbert_positions``, D48) it compiles to one graph."""
    from hf_hilbert_attn import ops
    from hf_hilbert_attn.inputs import model_positions

    monkeypatch.setattr(ops, "use_triton", lambda q, a, backend: True)
    torch._dynamo.reset()
    model = tiny_model("llama", "hilbert_dilated", hilbert_attn={"segment_lengths": [16, 32],
                                                                 "dilation_rates": [1, 2]})
    layer = model.model.layers[0]
    x = torch.randn(1, 48, 64)
    pos = torch.arange(48)[None]
    kw = dict(attention_mask=None, position_ids=pos,
              position_embeddings=model.model.rotary_emb(x, pos))
    if hooked:
        kw["hilbert_positions"] = model_positions(pos, None, None, 0, 1, 48, 48, x.device)
    want = layer(x, **kw)
    explained = torch._dynamo.explain(layer)(x, **kw)
    if hooked:
        assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    else:
        reasons = {str(b.reason).splitlines()[0] for b in explained.break_reasons}
        assert reasons and all("disable" in r for r in reasons), reasons
        where = {f.name for b in explained.break_reasons for f in b.user_stack[-1:]}
        assert where == {"hilbert_dilated_attention_forward"}, where
    got = torch.compile(layer)(x, **kw)
    # compiled around our op: the layer's other ops fused, so their sums in another order
    assert_rel_close(got[0] if isinstance(got, tuple) else got,
                     want[0] if isinstance(want, tuple) else want, what="compiled layer")
    torch._dynamo.reset()


def test_layer_index_read_only_for_per_layer_heads():
    """torch.compile guards the integers it reads off a module (torch 2.11: ``module.layer_idx ==
    0``): a compiled SmolLM2-135M recompiled the attention per layer and ran every layer past the
    8th uncompiled. The layer index is read only where per-layer dense heads make layers differ."""
    model = tiny_model("llama", "hilbert_dilated", hilbert_attn={"segment_lengths": [16, 32],
                                                                 "dilation_rates": [1, 2]})
    attn = model.model.layers[1].self_attn
    reads = []

    class Probe(type(attn)):
        @property
        def layer_idx(self):
            reads.append(1)
            return 1

    attn.__class__ = Probe
    q, kv = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
    plain = integ.hilbert_dilated_attention_forward(attn, q, kv, kv, None)[0]
    assert not reads
    hf_hilbert_attn.set_dense_kv_heads(model, {1: [0]})
    layered = integ.hilbert_dilated_attention_forward(attn, q, kv, kv, None)[0]
    assert reads
    assert not torch.equal(plain[:, :, :2], layered[:, :, :2])  # heads 0-1: dense now
    assert torch.equal(plain[:, :, 2:], layered[:, :, 2:])


@pytest.mark.parametrize("inputs", ["default", "packed", "padded", "all_ones", "fresh_cache"])
def test_configured_model_decides_positions_before_its_layers(monkeypatch, inputs):
    """``configure`` hooks the base model: a call without a given cache decides positions and
    documents once, eagerly, and hands them to every layer (``hilbert_positions``), whose own
    data-dependent position call (a graph break in each compiled layer) then never runs. The
    logits equal those of the same model without the hook. A mask of real tokens only reaches
    the mask function as None (its own check, a host sync, is not made again)."""
    pat = {"segment_lengths": [16, 32], "dilation_rates": [1, 2], "sink_tokens": 1}
    model = configure(tiny_model("llama", "hilbert_dilated", hilbert_attn=pat), pat)
    ids = torch.randint(0, VOCAB, (2, 48))
    kw = {"use_cache": inputs == "fresh_cache"}
    if inputs == "packed":
        kw["position_ids"] = torch.cat([torch.arange(20), torch.arange(28)])[None].expand(2, -1)
    if inputs in ("padded", "all_ones"):
        kw["attention_mask"] = torch.ones(2, 48, dtype=torch.long)
        kw["attention_mask"][1, :5] = 0 if inputs == "padded" else 1
    from transformers.masking_utils import AttentionMaskInterface

    calls, masks = [], []
    real = integ._positions
    monkeypatch.setattr(integ, "_positions", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "hilbert_dilated", lambda **k: (
        masks.append(k["attention_mask"]) or integ.hilbert_dilated_mask(**k)))
    hooked = model(input_ids=ids, **kw).logits
    assert not calls
    assert [m is None for m in masks] == [inputs != "padded"]
    model.model._hilbert_positions.remove()
    model.model._hilbert_positions = None
    masks.clear()
    plain = model(input_ids=ids, **kw).logits
    assert calls
    assert [m is None for m in masks] == [inputs not in ("padded", "all_ones")]
    assert torch.equal(hooked, plain)
    configure(model, pat)  # hooked again, once
    assert len(model.model._forward_pre_hooks) == 1
    configure(model, pat)
    assert len(model.model._forward_pre_hooks) == 1
