"""hf_hilbert_attn.long_context: tiled MLP, offloaded checkpoints, the loss backends.

Every option is compared with the plain model on a tiny random Llama (float64, 2 layers):
the loss and every parameter gradient must agree to float rounding, with and without gradient
checkpointing, under "sdpa" and "hilbert_dilated". Sequence lengths and chunk sizes are chosen
so that no chunk size divides the number of tokens.
"""

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from hf_hilbert_attn import DilatedPattern, configure
from hf_hilbert_attn.long_context import offload_checkpoints, offload_stats, tile_mlp
from hf_hilbert_attn.training import _liger_loss, chunked_lm_loss, enable_checkpointing, lm_loss

from conftest import assert_error_within, reorder_tol
from helpers import assert_close

HIDDEN, INTER, VOCAB, LAYERS = 32, 96, 64, 2
PATTERN = DilatedPattern([16, 32, 64], [1, 2, 4])  # segments shorter than the sequences
# float64 runs of the same function through another order of sums (chunks, tiles, offload):
# a sum's bound (at most 3 * 97 tokens, or INTER features) grown by up to 10x per stage through
# norms, softmax and products (embedding, 2 layers, head: 10**3) (conftest rule 1)
TOL = reorder_tol(3 * 97 + INTER, torch.float64) * 1e3  # ~1e-10


def tiny_llama(attn="sdpa"):
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=512, attention_dropout=0.0, use_cache=False)
    model = LlamaForCausalLM(cfg).to(torch.float64)
    if attn == "hilbert_dilated":
        configure(model, PATTERN)
    return model.train()


def loss_and_grads(model, ids, loss="hf", chunk=37):
    model.zero_grad(set_to_none=True)
    if loss == "hf":  # Transformers' loss (it upcasts the logits to float32)
        out = model(input_ids=ids, labels=ids).loss
    else:
        hidden = model.model(input_ids=ids).last_hidden_state
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        if loss == "full":  # the whole logits, in the model's dtype
            out = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten())
        else:
            out = lm_loss(hidden, model.lm_head.weight, labels, chunk, backend=loss)
    out.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return out.detach(), grads


def assert_same(got, want, what):
    assert_close("loss", got[0], want[0], TOL, what)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert_close(name, got[1][name], want[1][name], TOL, what)


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("attn", ["sdpa", "hilbert_dilated"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_option_and_all_together_are_exact(attn, checkpointing):
    model = tiny_llama(attn)
    if checkpointing:
        enable_checkpointing(model)
    ids = torch.randint(0, VOCAB, (2, 100))  # 200 tokens
    want = loss_and_grads(model, ids)

    tile_mlp(model, chunk_tokens=70)  # 200 = 2 * 70 + 60
    assert_same(loss_and_grads(model, ids), want, f"{attn} tiled")
    tile_mlp(model, 0)

    offload_checkpoints(model)
    assert_same(loss_and_grads(model, ids), want, f"{attn} offload")
    stats = offload_stats(model)
    assert stats.packed == (LAYERS if checkpointing else 0)
    offload_checkpoints(model, False)

    tile_mlp(model, 70)
    offload_checkpoints(model)
    assert_same(loss_and_grads(model, ids), want, f"{attn} tiled + offload")
    if attn == "sdpa":  # the loss does not see the attention; once is enough
        tile_mlp(model, 0)
        offload_checkpoints(model, False)
        full = loss_and_grads(model, ids, loss="full")
        assert_same(loss_and_grads(model, ids, loss="chunked"), full, "chunked loss")
        tile_mlp(model, 70)
        offload_checkpoints(model)
        assert_same(loss_and_grads(model, ids, loss="auto"), full, "all options, auto loss")


def test_tiled_mlp_float32_batch_and_no_grad():
    model = tiny_llama().float()
    exact_model = copy.deepcopy(model).double()  # the same weights, untiled, in float64
    enable_checkpointing(model)
    ids = torch.randint(0, VOCAB, (3, 97))  # 291 tokens, chunk 64 -> 4 * 64 + 35
    want = loss_and_grads(model, ids)
    exact = loss_and_grads(exact_model, ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        exact_logits = exact_model(input_ids=ids).logits
    tile_mlp(model, 64)
    got = loss_and_grads(model, ids)
    # tiles add the same float32 terms in another order: the untiled run's error size against
    # float64 (conftest rule 2), floor: the 291-token sums in another order (rule 1)
    floor = reorder_tol(3 * 97)
    assert_error_within("loss", got[0], want[0], exact[0], floor=floor * float(exact[0].abs()))
    for name in want[1]:
        assert_error_within(name, got[1][name], want[1][name], exact[1][name],
                            floor=floor * float(exact[1][name].abs().max()))
    with torch.no_grad():
        assert_error_within("logits", model(input_ids=ids).logits, logits, exact_logits,
                            floor=reorder_tol(INTER) * float(exact_logits.abs().max()))


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.dtypes.add(out.dtype)
        return out


def test_tiled_mlp_recomputes_under_the_forward_autocast():
    model = tiny_llama().float()
    tile_mlp(model, 45)
    ids = torch.randint(0, VOCAB, (2, 100))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    with _MatmulDtypes() as seen:  # backward outside autocast, as training loops do
        loss.backward()
    assert seen.dtypes == {torch.bfloat16}  # a float32 recompute would show float32 matmuls


def test_tiled_mlp_frozen_parameters_and_input_without_grad():
    model = tiny_llama()
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.randint(0, VOCAB, (1, 200))
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    tile_mlp(model, 33)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), n
        if p.requires_grad:
            assert_close(n, p.grad, want[n], TOL)


def test_tiled_mlp_with_dropout_recomputes_the_same_masks():
    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    mlp.down_proj = torch.nn.Sequential(torch.nn.Dropout(0.3), mlp.down_proj)
    x = torch.randn(2, 50, HIDDEN, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 50, HIDDEN, dtype=torch.float64)
    wrt = [x, *mlp.parameters()]
    # reference: the plain MLP on the same chunks from the same seed (the same masks)
    torch.manual_seed(1234)
    want = torch.cat([mlp(c) for c in x.reshape(-1, HIDDEN).split(30)]).view_as(x)
    want_grads = torch.autograd.grad(want, wrt, g)
    tile_mlp(model, 30)  # 100 = 3 * 30 + 10
    torch.manual_seed(1234)
    got = mlp(x)
    assert_close("output", got.detach(), want.detach(), TOL)
    torch.manual_seed(99)  # the backward must not depend on the RNG when it runs
    for a, b, n in zip(torch.autograd.grad(got, wrt, g), want_grads, ["x", "gate", "up", "down"]):
        assert_close(n, a, b, TOL)


# ------------------------------------------------------------------------------ memory
class _LargestIntermediate(TorchDispatchMode):
    """Largest number of token rows of any tensor an op creates whose last dim is ``dim``
    (default INTER), of ``dtype`` if given."""

    def __init__(self, dim=INTER, dtype=None):
        super().__init__()
        self.rows, self.dim, self.dtype = 0, dim, dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.dim \
                    and self.dtype in (None, t.dtype):
                self.rows = max(self.rows, t.numel() // self.dim)
        return out


def _saved_bytes(model, ids):
    """Bytes autograd saves during one forward (every saved tensor counted once)."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(seen.values())


def test_tiled_mlp_bounds_intermediate_activations():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 250))  # 500 tokens
    plain_saved = _saved_bytes(model, ids)
    with _LargestIntermediate() as plain:
        model(input_ids=ids, labels=ids).loss.backward()
    assert plain.rows == 500

    tile_mlp(model, 96)  # 500 = 5 * 96 + 20
    tiled_saved = _saved_bytes(model, ids)
    with _LargestIntermediate() as tiled:
        model(input_ids=ids, labels=ids).loss.backward()
    assert tiled.rows == 96  # forward and backward: one chunk's [chunk, intermediate] at a time
    # the gated MLP saved 4 [tokens, INTER] tensors (+ x) per layer; tiled, only x
    assert plain_saved - tiled_saved >= LAYERS * 4 * 500 * INTER * 8 - LAYERS * 500 * HIDDEN * 8


def test_tiled_norms_keep_their_float32_intermediates_to_a_chunk():
    # LlamaRMSNorm computes in float32; in this float64 model its [tokens, hidden] float32
    # intermediates (forward and backward) are the only float32 tensors of that width. The
    # layers' norms are tiled (the model's final norm is not a layer's: left out here).
    model = tiny_llama()
    model.model.norm = torch.nn.Identity()
    ids = torch.randint(0, VOCAB, (2, 250))  # 500 tokens
    want = loss_and_grads(model, ids)
    with _LargestIntermediate(HIDDEN, torch.float32) as plain:
        model(input_ids=ids, labels=ids).loss.backward()
    assert plain.rows == 500
    tile_mlp(model, 96)
    assert "forward" in model.model.layers[0].input_layernorm.__dict__
    with _LargestIntermediate(HIDDEN, torch.float32) as tiled:
        model(input_ids=ids, labels=ids).loss.backward()
    assert tiled.rows == 96
    assert_same(loss_and_grads(model, ids), want, "tiled norms")


def test_offload_packs_exactly_the_checkpointed_layer_inputs():
    model = tiny_llama()
    enable_checkpointing(model)
    offload_checkpoints(model)
    offload_checkpoints(model)  # idempotent
    ids = torch.randint(0, VOCAB, (2, 77))
    loss = model(input_ids=ids, labels=ids).loss
    stats = offload_stats(model)
    assert (stats.packed, stats.unpacked) == (LAYERS, 0)
    assert stats.packed_bytes == LAYERS * 2 * 77 * HIDDEN * 8  # one [B, S, hidden] per layer
    loss.backward()
    assert stats.unpacked == LAYERS
    with torch.no_grad():  # no backward, nothing saved
        model(input_ids=ids)
    assert stats.packed == LAYERS
    offload_checkpoints(model, enable=False)
    assert offload_stats(model) is None
    model(input_ids=ids, labels=ids).loss.backward()
    assert "forward" not in model.model.layers[0].__dict__


@pytest.mark.parametrize("prefetch", [True, False])
def test_offload_copy_path_and_prefetch(prefetch):
    # copy_cpu sends CPU tensors down the device path (copied out on pack, back on unpack), so
    # the copies, their order and the prefetch of the next-needed input are exercised here.
    model = tiny_llama()
    enable_checkpointing(model)
    ids = torch.randint(0, VOCAB, (2, 90))
    want = loss_and_grads(model, ids)
    offload_checkpoints(model, prefetch=prefetch)
    off = model.model.layers[0]._hf_offloader
    off.copy_cpu = True
    hidden_ptrs, packed = set(), []
    pack = off.pack

    def spy(t):
        hidden_ptrs.add(t.data_ptr())
        packed.append(pack(t))
        return packed[-1]

    off.pack = spy
    assert_same(loss_and_grads(model, ids), want, "offloaded copies")
    # the layer inputs are copied (an empty tensor, torch 2.11's checkpoint `dummy`, stays)
    copies = [p for p in packed if not isinstance(p, torch.Tensor)]
    assert len(copies) == LAYERS
    assert all(p.host.data_ptr() not in hidden_ptrs for p in copies)  # copies, not aliases
    stats = offload_stats(model)
    assert (stats.packed, stats.unpacked) == (LAYERS, LAYERS)
    assert stats.prefetched == (LAYERS - 1 if prefetch else 0)  # all but the last layer's
    assert off.order == [] and all(p.ready is None for p in copies)  # nothing left behind


@pytest.mark.parametrize("copy_cpu", [False, True])
def test_offload_passes_empty_tensors_through_uncounted(copy_cpu):
    # torch 2.11's non-reentrant checkpoint saves an empty `dummy` beside each layer's inputs:
    # pack and unpack hand it back as it is, uncounted, and it is no input to prefetch (giving
    # back the input packed after it fetches the one packed before it ahead, on the copy path)
    from hf_hilbert_attn.long_context import OffloadStats, _Offloader

    stats = OffloadStats()
    off = _Offloader(stats, pin_memory=False)
    off.copy_cpu = copy_cpu
    first, second = torch.randn(2, HIDDEN), torch.randn(3, HIDDEN)
    empty = torch.empty(0, requires_grad=True)
    saved = [off.pack(first), off.pack(empty), off.pack(second)]
    assert saved[1] is empty
    got = [off.unpack(s) for s in reversed(saved)]  # the backward's order
    assert got[1] is empty and torch.equal(got[0], second) and torch.equal(got[2], first)
    nbytes = (first.numel() + second.numel()) * first.element_size()
    assert stats == OffloadStats(packed=2, packed_bytes=nbytes, unpacked=2,
                                 prefetched=int(copy_cpu))
    assert off.order == []


def test_undo_restores_the_plain_modules():
    model = tiny_llama()
    sd = set(model.state_dict())
    tile_mlp(model, 10)
    tile_mlp(model, 20)  # changes the chunk, one patch
    assert model.model.layers[0].mlp._hf_tile_chunk == 20
    assert set(model.state_dict()) == sd
    tile_mlp(model, 0)
    for m in (model.model.layers[0].mlp, model.model.layers[0].post_attention_layernorm):
        assert "forward" not in m.__dict__ and not hasattr(m, "_hf_tile_chunk")


def test_bad_input_errors():
    model = tiny_llama()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        tile_mlp(model, -1)
    with pytest.raises(ValueError, match="no decoder layers"):
        tile_mlp(torch.nn.Linear(2, 2), 8)
    with pytest.raises(ValueError, match="no decoder layers"):
        offload_checkpoints(torch.nn.Linear(2, 2))
    h, w, y = torch.randn(1, 4, HIDDEN), torch.randn(VOCAB, HIDDEN), torch.zeros(1, 4).long()
    with pytest.raises(ValueError, match="one of auto, liger, chunked"):
        lm_loss(h, w, y, backend="fused")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        lm_loss(h, w, y, backend="liger")


# -------------------------------------------------------------------------------- liger
@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in Liger-Kernel module computing the same loss with PyTorch, to test our glue
    (argument order, reduction, ignore index, num_items) where Liger cannot run (no CUDA)."""
    calls = []

    class FakeLoss(torch.nn.Module):
        def __init__(self, ignore_index=-100, reduction="mean", accum_dtype=None, **kw):
            super().__init__()
            self.ignore_index, self.reduction = ignore_index, reduction

        def forward(self, lin_weight, _input, target, bias=None):
            calls.append((tuple(lin_weight.shape), tuple(_input.shape), tuple(target.shape)))
            return F.cross_entropy(_input @ lin_weight.t(), target,
                                   ignore_index=self.ignore_index, reduction=self.reduction)

    names = ["liger_kernel", "liger_kernel.transformers",
             "liger_kernel.transformers.fused_linear_cross_entropy"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].LigerFusedLinearCrossEntropyLoss = FakeLoss
    return calls


def test_liger_glue_matches_chunked_loss(fake_liger):
    h = torch.randn(2, 45, HIDDEN, dtype=torch.float64, requires_grad=True)
    w = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, 45))
    y[0, :7] = -100
    for num_items in (None, 123):
        want = chunked_lm_loss(h, w, y, 16, num_items=num_items)
        gw = torch.autograd.grad(want, (h, w))
        got = _liger_loss(h, w, y, num_items=num_items)
        gg = torch.autograd.grad(got, (h, w))
        assert got.dtype == want.dtype
        assert_close("loss", got.detach(), want.detach(), TOL)
        for a, b, n in zip(gg, gw, ("d hidden", "d weight")):
            assert_close(n, a, b, TOL)
    assert fake_liger[0] == ((VOCAB, HIDDEN), (90, HIDDEN), (90,))


def test_auto_loss_falls_back_on_cpu_even_with_liger_installed(fake_liger):
    h, w = torch.randn(1, 30, HIDDEN), torch.randn(VOCAB, HIDDEN)
    y = torch.randint(0, VOCAB, (1, 30))
    # float32, chunks of 7 vs the whole: the 30-token mean and the VOCAB-term softmax sums in
    # another order, each within its bound of the exact result (conftest rule 1)
    assert_close("loss", lm_loss(h, w, y, 7), chunked_lm_loss(h, w, y, 7),
                 2 * reorder_tol(30 + VOCAB + HIDDEN))
    assert fake_liger == []  # Liger runs only on CUDA


def test_tiled_layers_compile_with_the_same_losses():
    # compiled decoder layers (regional compilation, as tools.finetune --compile): the tiled MLP
    # stays an autograd Function; a norm runs whole inside the graph (the compiler fuses it)
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 100))
    want = loss_and_grads(model, ids)
    tile_mlp(model, 70)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    assert_same(loss_and_grads(model, ids), want, "tiled, compiled layers")
