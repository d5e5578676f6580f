"""Sharding layouts, shard_batch / gather_sequence, and exact per-rank pair counts."""

import random

import pytest
import torch

from _dist import run_distributed
from hf_hilbert_attn import DilatedPattern
from hf_hilbert_attn.sharding import (
    LAYOUTS, gather_sequence, padded_length, pairs_per_rank, shard_batch, shard_positions)

PATTERN = DilatedPattern([8, 32, 64], [1, 2, 4])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_is_a_partition(layout, world):
    s = random.choice([1, 37, 97, 128])
    table = shard_positions(s, world, layout, PATTERN)
    sp = padded_length(s, world, layout)
    assert table.shape == (world, sp // world)
    assert torch.equal(table.flatten().sort().values, torch.arange(sp)), "not a bijection"
    if layout == "zigzag":
        c = sp // (2 * world)
        assert torch.equal(table[0, :c], torch.arange(c))
        assert torch.equal(table[0, c:], torch.arange(sp - c, sp))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_batch_shifts_labels_before_sharding(layout):
    world, b, s = 4, 2, 53
    ids = torch.randint(0, 100, (b, s))
    labels = ids.clone()
    labels[torch.rand(b, s) < 0.25] = -100
    mask = torch.ones(b, s, dtype=torch.long)
    shards = [shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask},
                          (r, world), layout, PATTERN) for r in range(world)]
    total = 0
    for sh in shards:
        pos = sh["position_ids"]  # [B, L] true positions
        real = pos < s
        assert torch.equal(sh["input_ids"][real], ids.gather(1, pos.clamp(max=s - 1))[real])
        # the token at t predicts labels[t + 1]; the last token and padding predict nothing
        want = torch.where(pos + 1 < s, labels.gather(1, (pos + 1).clamp(max=s - 1)),
                           torch.full_like(pos, -100))
        assert torch.equal(sh["shift_labels"], want)
        assert torch.equal(sh["labels"], sh["shift_labels"])
        assert torch.equal(sh["attention_mask"], real.long())
        total += int(sh["num_items"])
    assert total == int((labels[:, 1:] != -100).sum()), "every label counted exactly once"


def test_shard_batch_packed_positions_give_global_doc_ids():
    pos = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0)  # two documents
    ids = torch.arange(1, 12).unsqueeze(0)  # token i + 1 at index i; padding gets id 0
    shards = [shard_batch({"input_ids": ids, "position_ids": pos}, (r, 2), "zigzag")
              for r in range(2)]
    for sh in shards:
        tokens = sh["input_ids"][0]
        real = tokens > 0
        want = torch.where(real, (tokens > 5).long(), torch.full_like(tokens, -1))
        assert torch.equal(sh["hilbert_doc_ids"][0], want)
        assert torch.equal(sh["position_ids"][0][real], pos[0][tokens[real] - 1])


def test_auto_layout_rule():
    from hf_hilbert_attn.sharding import resolve_layout

    pat = DilatedPattern([16, 64], [1, 4])
    assert resolve_layout("auto", 256, 4, pat) == "contiguous"  # shards = whole 64-segments
    assert resolve_layout("auto", 256, 8, pat) == "zigzag"  # 32-token shards split segments
    assert resolve_layout("auto", 250, 2, pat) == "zigzag"
    assert resolve_layout("auto", 256, 4, None) == "zigzag"
    assert resolve_layout("hilbert", 256, 4, pat) == "hilbert"
    # sliding windows: contiguous past the longest window; a dense key/value head is causal
    # attention over everything, balanced only by zigzag (D46)
    slide = DilatedPattern([16, 64], [1, 4], window="sliding")
    assert resolve_layout("auto", 256, 4, slide) == "contiguous"
    assert resolve_layout("auto", 256, 4, slide.replace(dense_kv_heads=[1])) == "zigzag"
    assert resolve_layout("auto", 256, 4, pat.replace(dense_kv_heads=[0])) == "zigzag"
    # the rule's claim: contiguous whole-segment shards need nothing remote
    from hf_hilbert_attn.ring import plan_ring

    table = shard_positions(256, 4, "auto", pat)
    pos = [t.unsqueeze(0) for t in table]
    assert all(plan_ring(pat, 4, 2, True, r, pos, pos).entries_sent() == 0 for r in range(4))
    assert len(set(pairs_per_rank(pat, 256, 4, "auto", num_heads=4))) == 1, "equal work"


def test_shard_batch_errors():
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_batch({"input_ids": ids}, (0, 2), "spiral")
    with pytest.raises(ValueError, match="layout='hilbert' needs the DilatedPattern"):
        shard_batch({"input_ids": ids}, (0, 2), "hilbert")
    with pytest.raises(ValueError, match="batch needs 'input_ids'"):
        shard_batch({"labels": ids}, (0, 2))
    with pytest.raises(ValueError, match="rank must be in"):
        shard_batch({"input_ids": ids}, (2, 2))
    with pytest.raises(ValueError, match="length 8"):
        shard_batch({"input_ids": ids, "labels": torch.zeros(1, 9, dtype=torch.long)}, (0, 2))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pairs_per_rank_equals_brute_force(layout):
    s, world, heads = random.choice([61, 96, 130]), random.choice([2, 3, 4]), 4
    pat = DilatedPattern([8, 24, 64], [1, 3, 4], query_dilation=random.choice(["per_head", "all"]))
    got = pairs_per_rank(pat, s, world, layout, num_heads=heads)
    mask = pat.build_mask(heads, torch.arange(s), torch.arange(s))[0]  # [H, S, S]
    per_query = mask.sum((0, 2))
    table = shard_positions(s, world, layout, pat)
    want = [int(per_query[t[t < s]].sum()) for t in table]
    assert got == want
    assert sum(got) == pat.count_pairs_total(s, heads)


def _worker_gather(rank, world):
    import torch.distributed as dist

    s = 45
    x = torch.arange(2 * s * 3, dtype=torch.float64).view(2, s, 3)
    with pytest.raises(ValueError, match="needs seq_len"):
        gather_sequence(x, dist.group.WORLD, "auto")
    for layout in LAYOUTS + ("auto",):
        table = shard_positions(s, world, layout, PATTERN)
        xp = torch.cat([x, torch.full((2, table.numel() - s, 3), -1.0)], 1)
        mine = xp[:, table[rank]].clone().requires_grad_()
        full = gather_sequence(mine, dist.group.WORLD, layout, seq_len=s, pattern=PATTERN)
        assert torch.equal(full, x), f"exact: gather_sequence inverts shard ({layout})"
        (full * (rank + 1)).sum().backward()  # gradient of every rank's use of its slice
        real = table[rank] < s
        assert torch.equal(mine.grad[:, real], torch.full_like(mine.grad[:, real],
                                                               world * (world + 1) / 2))
    return True


def test_gather_sequence_inverts_shard_batch():
    run_distributed(_worker_gather, 2, timeout=90)


def test_auto_layout_rule_with_sinks_and_sliding_windows():
    from hf_hilbert_attn.ring import plan_ring
    from hf_hilbert_attn.sharding import resolve_layout

    # segment windows with sinks: the old rule; whole-segment shards send only the sink rows
    pat = DilatedPattern([16, 64], [1, 4], sink_tokens=3)
    assert resolve_layout("auto", 256, 4, pat) == "contiguous"
    assert resolve_layout("auto", 256, 8, pat) == "zigzag"
    pos = [t.unsqueeze(0) for t in shard_positions(256, 4, "auto", pat)]
    sent = [plan_ring(pat, 4, 2, True, r, pos, pos).entries_sent() for r in range(4)]
    assert sent == [3 * 2 * 3, 0, 0, 0], sent  # 3 sinks x 2 kv heads to each later rank
    # sliding windows: contiguous while the longest window fits in the sequence
    slide = DilatedPattern([64, 256], [1, 4], window="sliding", sink_tokens=2)
    assert resolve_layout("auto", 1024, 4, slide) == "contiguous"
    assert resolve_layout("auto", 256, 4, slide) == "contiguous"
    assert resolve_layout("auto", 255, 4, slide) == "zigzag"
    assert resolve_layout("auto", 1024, 4, slide.replace(segment_lengths=[64, 1025])) == "zigzag"
    assert resolve_layout("zigzag", 1024, 4, slide) == "zigzag"
    # the rule's claim: then contiguous shards are as balanced as zigzag ones and send less
    work, volume = {}, {}
    for layout in ("contiguous", "zigzag"):
        pairs = pairs_per_rank(slide, 1024, 4, layout, num_heads=4)
        work[layout] = max(pairs) * 4 / sum(pairs)
        pos = [t.unsqueeze(0) for t in shard_positions(1024, 4, layout, slide)]
        volume[layout] = sum(plan_ring(slide, 4, 2, True, r, pos, pos).entries_sent()
                             for r in range(4))
    assert work["contiguous"] <= work["zigzag"] + 0.01, work
    assert volume["contiguous"] < 0.7 * volume["zigzag"], volume


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_pairs_per_rank_with_sinks_and_sliding_equals_brute_force(layout):
    s, world, heads = random.choice([61, 96, 130]), random.choice([2, 3, 4]), 4
    pat = DilatedPattern([8, 24, 64], [1, 3, 4], window=random.choice(["segment", "sliding"]),
                         sink_tokens=random.choice([1, 3, 5]),
                         query_dilation=random.choice(["per_head", "all"]))
    got = pairs_per_rank(pat, s, world, layout, num_heads=heads)
    per_query = pat.build_mask(heads, torch.arange(s), torch.arange(s))[0].sum((0, 2))
    table = shard_positions(s, world, layout, pat)
    assert got == [int(per_query[t[t < s]].sum()) for t in table], pat


def test_calibrated_per_layer_dense_heads_shard_in_zigzag():
    # a calibration stores dense heads per layer, outside the shared pattern: the collators ask
    # sharding_pattern, which carries any layer's dense heads, so `auto` picks zigzag (D46)
    from types import SimpleNamespace

    from hf_hilbert_attn.integrations.model_config import LAYER_DENSE, sharding_pattern
    from hf_hilbert_attn.sharding import resolve_layout

    slide = DilatedPattern([16, 64], [1, 4], window="sliding")
    plain = SimpleNamespace(hilbert_attn=slide.to_dict())
    calibrated = SimpleNamespace(hilbert_attn={**slide.to_dict(), LAYER_DENSE: [[], [1], [0, 1]]})
    assert sharding_pattern(plain) == slide
    assert sharding_pattern(calibrated).dense_kv_heads == (0, 1)
    assert resolve_layout("auto", 256, 4, sharding_pattern(plain)) == "contiguous"
    assert resolve_layout("auto", 256, 4, sharding_pattern(calibrated)) == "zigzag"
