"""A padded row computes what it computes alone (issue: left-padded batches were silently wrong).

The pattern reads absolute positions (segments, dilation classes, sinks), so the pads of a
left-padded row must not count. SDPA (rotary positions are relative) gives batched == alone;
so must we, with and without ``position_ids``, left and right padding, for every shipped pattern
(windows scaled down so that 70 tokens cross several of them) and every supported family.
"""

from __future__ import annotations

import pytest
import torch

from hf_hilbert_attn import configure, patterns
from hf_hilbert_attn.inputs import padded_positions

from test_transformers import FAMILIES, generate_position_ids, tiny_model, tokens

LENGTH = 70
# float32 end to end: batched and alone differ only in the order of reductions (longer key rows,
# rotary angles shifted by the pad count); ~1e-6 relative per op, a few hundred ops deep.
REL = 1e-4


def scaled(name: str, factor: int = 128):
    """A shipped pattern with every window divided by ``factor`` (rates kept): sparse at 70."""
    p = patterns.load(name)
    w = [max(r, wi // factor) for wi, r in zip(p.segment_lengths, p.dilation_rates)]
    return p.replace(segment_lengths=w)


def _rows_alone(model, ids, mask):
    out = []
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        out.append(model(ids[b:b + 1, real]).logits[0])
    return out


def _check(model, ids, mask, position_ids, what):
    got = model(ids, attention_mask=mask, position_ids=position_ids).logits
    for b, alone in enumerate(_rows_alone(model, ids, mask)):
        real = mask[b].bool()
        scale = alone.abs().max()
        err = (got[b, real] - alone).abs().max()
        assert err <= REL * scale, f"{what}, row {b}: max |diff| {err:.3g} > {REL} * {scale:.3g}"


def _masks(kind):
    mask = torch.ones(3, LENGTH, dtype=torch.long)
    for b, p in enumerate([0, 9, 23]):
        if kind == "left":
            mask[b, :p] = 0
        else:
            mask[b, LENGTH - p:] = 0
    return mask


@pytest.mark.parametrize("name", [n for n in patterns.names() if n != "dense"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_row_equals_row_alone_every_shipped_pattern(name, side):
    model = configure(tiny_model("llama"), scaled(name))
    ids, mask = tokens(3, LENGTH), _masks(side)
    for pos in (None, generate_position_ids(mask)):
        given = "given" if pos is not None else "none"
        _check(model, ids, mask, pos, f"{name}/{side}/position_ids={given}")


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_row_equals_row_alone_every_family(family):
    model = configure(tiny_model(family), scaled("default"))
    ids, mask = tokens(3, LENGTH), _masks("left")
    # GPT-2's learned absolute position embeddings see the pads unless position_ids skip them
    # (SDPA differs from the row alone there too): only the positions generate() passes.
    for pos in ([generate_position_ids(mask)] if family == "gpt2" else
                [None, generate_position_ids(mask)]):
        _check(model, ids, mask, pos, family)
    # The pattern matters at this length: the same row under dense attention differs.
    real = mask[2].bool()
    sparse = model(ids[2:3, real]).logits
    configure(model, "dense")
    assert (model(ids[2:3, real]).logits - sparse).abs().max() > 1e-3


def test_padded_positions_are_a_permutation_with_real_tokens_from_zero():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 0, 1]]).bool()
    pos = padded_positions(None, mask)
    assert pos.tolist() == [[3, 4, 0, 1, 2], [0, 1, 2, 3, 4], [3, 0, 1, 4, 2]]
    # given positions of the real tokens are kept; pads follow the row's last one
    given = torch.tensor([[7, 7, 0, 1, 2]])
    assert padded_positions(given, mask[:1]).tolist() == [[3, 4, 0, 1, 2]]
