"""Models with chunked attention layers (Llama 4: ``layer_types`` ``"chunked_attention"``,
``attention_chunk_size``): such a layer keeps exactly its chunks (query and key in the same chunk
of true positions, causal), the full-attention layers run the dilated pattern. A tiny random
``llama4_text`` on the CPU, chunks of 16 that every prompt below crosses."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers import masking_utils
from transformers.masking_utils import (and_masks, causal_mask_function,
                                        chunked_causal_mask_function,
                                        packed_sequence_mask_function)

import hf_hilbert_attn
from hf_hilbert_attn import DilatedPattern, configure, get_pattern
from hf_hilbert_attn.integrations import transformers as integ
from hf_hilbert_attn.integrations.model_config import layer_window
from hf_hilbert_attn.integrations.transformers_checks import _CHUNKS_BY_ROW, mask_window
from hf_hilbert_attn.tools.cli import main as cli_main
from test_layer_types import _reference_layer, generates_as_sdpa, padded_as_sdpa
from test_transformers import (DENSE, SMALL, VOCAB, assert_rel_close, generate_position_ids,
                               left_pad_mask, tokens)

CHUNK = 16
CHUNKED, FULL = "chunked_attention", "full_attention"
KINDS = [CHUNKED, FULL, CHUNKED]
CHUNKS = DilatedPattern([CHUNK], [1])  # window "segment": p // 16 == s // 16, causal


def tiny(attn: str = "sdpa", chunk=CHUNK):
    """Llama 4's layout: chunked layers with RoPE, a full layer without (and its temperature
    tuning); dense MLPs (no MoE router whose ties could flip between two attentions)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        intermediate_size_mlp=128, num_hidden_layers=len(KINDS), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_layers=[], max_position_embeddings=512,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attention_chunk_size=chunk, layer_types=KINDS,
        no_rope_layers=[int(k == CHUNKED) for k in KINDS])
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                            dtype=torch.float32).eval()


def test_chunked_layers_run_their_chunks(tmp_path, capsys):
    """``get_pattern(config, layer)``: the chunks in a chunked layer, the pattern elsewhere;
    ``show-pattern MODEL_DIR`` lists the chunked layers."""
    model = configure(tiny(), SMALL)
    config = model.config
    for i, kind in enumerate(KINDS):
        assert layer_window(config, i) == (CHUNKS if kind == CHUNKED else None)
        assert get_pattern(config, i) == (CHUNKS if kind == CHUNKED else SMALL), i
    assert get_pattern(config) == SMALL
    model.save_pretrained(tmp_path)
    assert cli_main(["show-pattern", str(tmp_path), "--length", "64"]) == 0
    assert f"chunked layers (each keeps its chunks of {CHUNK} tokens; the others run the " \
           "pattern): 0 2  (2 of 3)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"layer 0: a sliding-window or chunked layer keeps"):
        hf_hilbert_attn.set_dense_kv_heads(model, {0: [1]})


def test_with_the_dense_pattern_chunked_layers_equal_sdpa():
    """Logits, loss and every gradient equal sdpa's, also for a left-padded batch (Transformers
    starts a padded row's chunks at its first real token, as its positions do); the chunks
    matter (the same weights with chunks longer than the prompt give other logits)."""
    padded_as_sdpa(tiny(), tiny(chunk=512), 57, 11)


def test_packed_documents_restart_their_chunks():
    """Packed documents (restarting ``position_ids``): each document's chunks start at its first
    token, as Transformers counts them where it remaps packed positions; a Transformers that
    counts them from the row's first token instead is refused in one line."""
    model = configure(tiny(), DENSE)
    lengths = [21, 30, 9]
    ids = tokens(1, sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    if _CHUNKS_BY_ROW:
        with pytest.raises(ValueError, match="counts the chunks of a packed row") as e:
            model(ids, position_ids=position_ids, use_cache=False)
        assert "\n" not in str(e.value)
        return
    # (without a cache: Transformers reads packing from position_ids only then)
    got, want = logits_under(model, ids, "hilbert_dilated", "sdpa", position_ids=position_ids,
                             use_cache=False)
    assert_rel_close(got, want, what="packed logits")
    unpacked = logits_under(model, ids, "sdpa")[0]  # the restarts matter
    assert (unpacked - want).abs().max() > 1e-3 * want.abs().max()


def logits_under(model, ids, *implementations, **kw) -> list:
    """The model's logits under each attention implementation in turn (no gradients)."""
    out = []
    with torch.no_grad():
        for implementation in implementations:
            model.set_attn_implementation(implementation)
            out.append(model(ids, **kw).logits)
    return out


def test_a_sparse_pattern_runs_on_full_layers_only():
    """With a sparse pattern (and a dense head in the full layer), the model equals one whose
    layers run the reference attention of ``get_pattern(config, layer)``: the chunked layers
    keep their chunks."""
    AttentionInterface.register("hilbert_reference_test", _reference_layer)
    model = configure(tiny(), SMALL)
    hf_hilbert_attn.set_dense_kv_heads(model, {1: [1]})
    got, want, dense = logits_under(model, tokens(2, 57), "hilbert_dilated",
                                    "hilbert_reference_test", "sdpa")
    assert_rel_close(got, want, what="logits vs the reference")
    assert (got - dense).abs().max() > 1e-3 * dense.abs().max()


def _static_generation_works() -> bool:
    # Transformers 5.17 passes create_chunked_causal_mask an argument it does not take (sdpa
    # fails there too)
    return "block_sequence_ids" in inspect.signature(
        masking_utils.create_chunked_causal_mask).parameters or "block_sequence_ids" not in \
        inspect.getsource(masking_utils.create_masks_for_generate)


@pytest.mark.parametrize("cache", ["dynamic", "static", "pattern"])
def test_generation_keeps_the_chunks(cache):
    """Greedy generation across several chunks gives sdpa's tokens and logits: left-padded rows
    with Transformers' caches (a chunked layer's cache keeps its last chunk - 1 keys, and the
    mask says where they start), unpadded rows with a PatternCache, whose chunked layers keep
    only the current chunk's keys."""
    if cache == "static" and not _static_generation_works():
        pytest.skip("this Transformers cannot generate chunked layers with a static cache")
    stored = generates_as_sdpa(configure(tiny(), DENSE), 29, [0, 5, 13], cache, 2 * CHUNK + 3)
    if cache == "pattern":
        assert [layer.is_sliding for layer in stored] == [k == CHUNKED for k in KINDS]
        assert all(layer.keys.shape[-2] < CHUNK for layer, k in zip(stored, KINDS)
                   if k == CHUNKED)


def test_generation_with_a_sparse_pattern_equals_the_full_forward():
    """With a sparse pattern on the full layer, every step of a left-padded generation (the
    chunked layers' caches keep their last keys) equals a full forward of the sequence."""
    model = configure(tiny(), SMALL)
    new = 2 * CHUNK
    ids, mask = tokens(2, 37), left_pad_mask(2, 37, [0, 7])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :new])], dim=1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask,
                     position_ids=generate_position_ids(full_mask)).logits
    for t, step_logits in enumerate(out.logits):
        assert_rel_close(step_logits, full[:, 37 + t - 1], what=f"step {t}")


def test_chunks_the_config_does_not_declare_are_refused():
    """A layer whose mask applies other chunks (or none, or chunks where the config declares
    full attention) is refused in one line, never run with the wrong ones."""
    model = configure(tiny(), SMALL)
    q, kv = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16)
    attn = [layer.self_attn for layer in model.model.layers]
    start = torch.zeros(1, dtype=torch.long)
    full, chunked, other = (integ.hilbert_dilated_mask(1, 20, 20, mask_function=f) for f in (
        None, chunked_causal_mask_function(CHUNK, start), chunked_causal_mask_function(8, start)))
    assert (full.window, chunked.window, other.window) == (None, CHUNKS, DilatedPattern([8], [1]))
    integ.hilbert_dilated_attention_forward(attn[0], q, kv, kv, chunked)
    for layer, info in [(attn[0], other), (attn[0], full), (attn[1], chunked)]:
        with pytest.raises(ValueError, match=r"layer \d applies .* but its config declares") as e:
            integ.hilbert_dilated_attention_forward(layer, q, kv, kv, info)
        assert "\n" not in str(e.value)
    assert "applies chunks of 8 (mask)" in str(pytest.raises(
        ValueError, integ.hilbert_dilated_attention_forward, attn[0], q, kv, kv, other).value)


def test_mask_functions_name_their_chunks():
    """The chunks are read from Transformers' own mask function, under the packed-sequence
    wrappers too; chunks with a sliding window are refused."""
    fn = chunked_causal_mask_function(CHUNK, torch.zeros(2, dtype=torch.long))
    assert mask_window(fn) == CHUNKS
    if not _CHUNKS_BY_ROW:
        packed = masking_utils.remap_positions_for_packed_sequence(fn, torch.zeros(1, 4).long())
        assert mask_window(and_masks(packed, packed_sequence_mask_function(
            torch.zeros(1, 4, dtype=torch.long)))) == CHUNKS
    with pytest.raises(ValueError, match="cannot apply the mask function"):
        mask_window(and_masks(fn, masking_utils.sliding_window_causal_mask_function(4)))
    assert mask_window(causal_mask_function) is None


def test_a_chunked_layers_cache_keeps_the_positions_of_its_keys():
    """Transformers' chunked cache layer keeps the last keys and says where they start
    (``kv_offset``): chunks read true positions, so the mask keeps every slot's padding (a row
    starts its chunks at its first real token) and the keys are its last ``kv_length`` slots."""
    mask = left_pad_mask(2, 40, [0, 5])
    fn = chunked_causal_mask_function(CHUNK, torch.tensor([0, 5]))
    info = integ.hilbert_dilated_mask(2, 1, CHUNK, q_offset=39, kv_offset=40 - CHUNK,
                                      mask_function=fn, attention_mask=mask)
    assert (info.q_offset, info.kv_offset, info.kv_length) == (39, 0, CHUNK)
    assert info.padding_mask.shape == (2, 40)
    from hf_hilbert_attn.inputs import model_positions

    at = model_positions(None, None, info.padding_mask, 39, 2, 1, CHUNK, "cpu")
    assert at.q_positions.tolist() == [[39], [34]]
    assert at.k_positions.tolist() == [list(range(24, 40)), list(range(19, 35))]
    # without a padding mask: every slot real, absolute positions all the same
    info = integ.hilbert_dilated_mask(2, 1, CHUNK, q_offset=39, kv_offset=40 - CHUNK,
                                      mask_function=fn)
    assert info.padding_mask.shape == (2, 40) and bool(info.padding_mask.all())
