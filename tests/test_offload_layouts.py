"""offload_checkpoints under both places Transformers puts the checkpoint call.

Transformers 5.2x checkpoints inside the decoder layer's ``forward``; 5.17 (the GPU image)
inside ``__call__``, around ``Module.__call__``. Offload hooks pushed from an instance
``forward`` sat inside the checkpoint on 5.17 and took every activation to the host (the host
OOM at >= 256K tokens). Here a layer class that checkpoints in ``__call__`` emulates 5.17.
"""
from functools import partial

import pytest
import torch

from hf_hilbert_attn.long_context import offload_checkpoints, offload_stats
from hf_hilbert_attn.training import enable_checkpointing

from test_long_context import HIDDEN, LAYERS, VOCAB, assert_same, loss_and_grads, tiny_llama


def _checkpoint_in_call(model):
    """Turn every decoder layer into one whose ``__call__`` checkpoints ``Module.__call__``."""
    for layer in model.model.layers:
        base = type(layer)
        plain = getattr(base.forward, "__wrapped__", base.forward)

        class CallCheckpointed(base):
            def __call__(self, *args, **kwargs):
                if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    return self._gradient_checkpointing_func(
                        partial(torch.nn.Module.__call__, self, **kwargs), *args)
                return torch.nn.Module.__call__(self, *args, **kwargs)

        CallCheckpointed.forward = plain  # after class creation: not wrapped again
        layer.__class__ = CallCheckpointed
    return model


@pytest.mark.parametrize("layout", ["forward", "call"])
@pytest.mark.parametrize("order", ["checkpointing_first", "offload_first"])
def test_offload_packs_only_layer_inputs_in_either_layout(layout, order):
    model = tiny_llama()
    if layout == "call":
        _checkpoint_in_call(model)
    ids = torch.randint(0, VOCAB, (2, 45))
    if order == "checkpointing_first":
        enable_checkpointing(model)
        want = loss_and_grads(model, ids)
        offload_checkpoints(model)
    else:
        offload_checkpoints(model)  # checkpointing enabled afterwards: wrapped at forward
        enable_checkpointing(model)
        want = None
    got = loss_and_grads(model, ids)
    stats = offload_stats(model)
    # one [B, S, hidden] per layer: the checkpoint's saved inputs, no activation inside it
    assert (stats.packed, stats.unpacked) == (LAYERS, LAYERS)
    assert stats.packed_bytes == LAYERS * 2 * 45 * HIDDEN * 8
    offload_checkpoints(model, enable=False)
    plain = loss_and_grads(model, ids)
    assert_same(got, plain if want is None else want, f"offload, checkpoint in {layout}")
    assert offload_stats(model) is None
    assert all(not hasattr(layer._gradient_checkpointing_func, "_hf_offload_inner")
               for layer in model.model.layers)
