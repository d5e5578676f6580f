"""DeepSpeed's Ulysses sequence parallelism (what Accelerate's ``ParallelismConfig(sp_size=N,
sp_backend="deepspeed")`` runs) around ``attn_implementation="hilbert_dilated"``: DeepSpeed moves
the shards from sequence to heads and calls our attention function with a rank's slice of the
heads over the whole sequence; the function must number them as one process does (per-head
classes, dense key/value heads). Two gloo processes against one process: logits and every
gradient. Skipped where DeepSpeed is not installed (it is not a dependency)."""

import pytest
import torch

from _dist import run_distributed
from conftest import model_tol

pytest.importorskip("deepspeed")

S, HIDDEN = 48, 64


def _model(seed, pattern):
    import transformers

    import hf_hilbert_attn

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=HIDDEN, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).float()
    hf_hilbert_attn.configure(model, pattern)
    return model.train()


def _grads_and_logits(model, ids, pos, weights):
    logits = model(input_ids=ids, position_ids=pos).logits
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, seed, pattern):
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (1, S), generator=g)
    pos = torch.arange(S)[None]
    weights = torch.randn(1, S, 101, generator=g)
    whole = _grads_and_logits(_model(seed, pattern), ids, pos, weights)  # one process
    model = _model(seed, pattern)
    UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="hilbert_dilated", sequence_parallel_size=world,
        micro_batch_size=1, seq_length_is_variable=True)
    part = slice(rank * S // world, (rank + 1) * S // world)  # DeepSpeed's contiguous shards
    logits, grads = _grads_and_logits(model, ids[:, part], pos[:, part], weights[:, part])
    gathered = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(gathered, logits)
    for gr in grads.values():  # each rank's loss is its shard's: the sum is the whole loss
        dist.all_reduce(gr)
    tol = model_tol(S, S, HIDDEN)
    err = (torch.cat(gathered, 1) - whole[0]).abs().max().item()
    scale = whole[0].abs().max().item()
    assert err <= tol * scale, (err, scale)
    for name, gr in grads.items():
        ref = whole[1][name]
        assert (gr - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1e-30), name
    return err


@pytest.mark.parametrize("pattern", [
    {"segment_lengths": [8, 16, 48], "dilation_rates": [1, 2, 4]},  # per-head classes
    {"segment_lengths": [8, 16, 48], "dilation_rates": [1, 2, 4], "window": "sliding",
     "sink_tokens": 1, "dense_kv_heads": [1]}], ids=["classes", "dense_head"])
def test_deepspeed_ulysses_equals_one_process(pattern):
    run_distributed(_worker, 2, 1234, pattern, timeout=240)
