"""Activation memory of long-sequence training outside attention, for HF causal LMs whose
decoder layers are Transformers' ``GradientCheckpointingLayer`` (Llama, Qwen2, Mistral, ...).

With gradient checkpointing, what a step keeps grows with the sequence ``S`` in three places
(docs/long_context.md has the arithmetic):

* every layer's checkpointed input, ``[S, hidden]`` per layer, for the whole backward —
  :func:`offload_checkpoints` keeps them in (pinned) host memory instead;
* the MLP and norms of the layer being recomputed, ``[S, intermediate]`` and float32 ``[S,
  hidden]`` tensors — :func:`tile_mlp` runs them and their backward ``chunk_tokens`` rows at a time;
* the logits, ``[S, vocab]`` — :func:`hf_hilbert_attn.training.lm_loss`: Liger-Kernel's fused
  linear cross-entropy on CUDA where it is installed, else chunked.

Each option changes where and when values are computed, never what (tests/test_long_context.py).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = ["tile_mlp", "offload_checkpoints", "OffloadStats", "offload_stats"]


def _decoder_layers(model, what: str):
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{what}: {type(model).__name__} has no decoder layers derived from "
                         "transformers' GradientCheckpointingLayer")
    return layers


def _patch_forward(mlp) -> None:
    """Put :func:`_tiled_mlp_forward` in front of ``mlp.forward`` (an instance attribute, so the
    state dict, the class and other instances are untouched); the previous ``forward`` — the
    class's, or an instance one such as accelerate's hooks — is kept for ``tile_mlp(m, 0)``."""
    inner = mlp.forward
    mlp._hf_tile_saved = (inner, "forward" in mlp.__dict__)
    mlp.forward = lambda *args, **kwargs: _tiled_mlp_forward(mlp, inner, *args, **kwargs)


# ------------------------------------------------------------------------------ tiled MLP
class _TiledMLPFunction(torch.autograd.Function):
    """``y = forward(x)`` for a token-wise ``forward``, ``chunk`` rows of ``x.reshape(-1, H)``
    at a time. Saves only ``x``; backward recomputes each chunk under autograd and takes its
    gradients at once, so one chunk's ``[chunk, intermediate]`` tensors exist at a time.
    ``params`` are inputs, so one AccumulateGrad per parameter per step (as DDP expects). With
    ``rng`` (dropout) each chunk's RNG state is restored for its recompute (the same masks)."""

    @staticmethod
    def forward(ctx, forward, chunk: int, rng: bool, x: torch.Tensor, *params):
        ctx.forward, ctx.chunk, ctx.params = forward, chunk, params
        dt = x.device.type  # the autocast state the chunks are recomputed under
        ctx.autocast = (dt, (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                        if torch.amp.is_autocast_available(dt) else None)
        ctx.rng = [] if rng else None
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        out = None
        for i in range(0, rows.shape[0], chunk):
            if rng:
                ctx.rng.append((torch.get_rng_state(), torch.cuda.get_rng_state(x.device)
                                if dt == "cuda" else None))
            y = forward(rows[i:i + chunk])
            if not isinstance(y, torch.Tensor) or y.shape[0] != rows[i:i + chunk].shape[0]:
                raise TypeError("tile_mlp: the MLP must map [tokens, hidden] to one tensor "
                                f"[tokens, out], got {type(y).__name__}")
            out = y.new_empty((rows.shape[0], *y.shape[1:])) if out is None else out
            out[i:i + chunk] = y
        return out.view(*x.shape[:-1], *out.shape[1:])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params, chunk = ctx.params, ctx.chunk
        rows = x.reshape(-1, x.shape[-1])
        g_rows = grad_out.reshape(rows.shape[0], -1)
        want_x = ctx.needs_input_grad[3]
        want_p = [j for j, p in enumerate(params) if ctx.needs_input_grad[4 + j]]
        dx = torch.empty_like(rows) if want_x else None
        # Parameter gradients summed over chunks in float32 at least: one GEMM over all rows
        # would accumulate in float32 too, then round once.
        acc = [None] * len(params)
        device_type, state = ctx.autocast
        autocast = (torch.autocast(device_type, dtype=state[1], enabled=state[0])
                    if state is not None else contextlib.nullcontext())
        cuda = [x.device] if x.device.type == "cuda" else []
        with torch.enable_grad(), autocast, \
                torch.random.fork_rng(devices=cuda, enabled=ctx.rng is not None):
            for k, i in enumerate(range(0, rows.shape[0], chunk)):
                if ctx.rng is not None:  # (the CPU's and the device's, saved in the forward)
                    torch.set_rng_state(ctx.rng[k][0])
                    if cuda:
                        torch.cuda.set_rng_state(ctx.rng[k][1], x.device)
                xc = rows[i:i + chunk].detach().requires_grad_(want_x)
                inputs = ([xc] if want_x else []) + [params[j] for j in want_p]
                grads = list(torch.autograd.grad(ctx.forward(xc), inputs, g_rows[i:i + chunk],
                                                 allow_unused=True))
                if want_x:
                    g = grads.pop(0)
                    dx[i:i + chunk] = 0 if g is None else g
                for j, g in zip(want_p, grads):
                    if g is not None and acc[j] is None:
                        acc[j] = g.to(torch.promote_types(g.dtype, torch.float32))
                    elif g is not None:
                        acc[j] += g
        pgrads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (None, None, None, dx.view_as(x) if want_x else None, *pgrads)


def _tiled_mlp_forward(mlp, inner, x, *args, **kwargs):
    chunk = mlp._hf_tile_chunk
    if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2 \
            or x.numel() // x.shape[-1] <= chunk \
            or torch.compiler.is_compiling() and type(mlp).__name__.endswith("Norm"):
        return inner(x, *args, **kwargs)  # (compiled, a norm is fused: it keeps x, a scale a row)
    rng = mlp.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())
    return _TiledMLPFunction.apply(inner, chunk, rng, x, *mlp.parameters())


def tile_mlp(model, chunk_tokens: int = 8192):
    """Run every decoder layer's ``mlp`` and norms over ``chunk_tokens`` tokens at a time
    (batch and sequence flattened), forward and backward; ``chunk_tokens=0`` restores them.

    One chunk's ``[chunk, intermediate]`` activations and a norm's float32 ``[chunk, hidden]``
    exist at a time (:class:`_TiledMLPFunction`; dropout masks are replayed; compiled, a norm
    runs whole, fused): exact for token-wise modules, for one more forward of them per step.
    Norms: a layer's children whose class name ends in ``Norm``. Calling again changes the
    chunk; shorter inputs run the plain modules; the state dict is unchanged.

    ``model``: a Transformers model (or a module containing one), returned changed in place.
    ``ValueError``: a negative ``chunk_tokens`` or no decoder layer with an ``mlp``.
    """
    chunk = int(chunk_tokens)
    if chunk < 0:
        raise ValueError(f"tile_mlp: chunk_tokens must be >= 0 (0 = off), got {chunk_tokens}")
    layers = _decoder_layers(model, "tile_mlp")
    mlps = [ly.mlp for ly in layers if isinstance(getattr(ly, "mlp", None), torch.nn.Module)]
    if not mlps:
        raise ValueError(f"tile_mlp: no decoder layer of {type(model).__name__} has an `mlp`")
    norms = [m for layer in layers for m in layer.children() if type(m).__name__.endswith("Norm")]
    for mlp in mlps + norms:
        if chunk == 0:
            saved = mlp.__dict__.pop("_hf_tile_saved", None)
            if saved is not None and saved[1]:  # an instance forward: put it back
                mlp.forward = saved[0]
            elif saved is not None:  # the class's forward: drop ours
                del mlp.forward
            mlp.__dict__.pop("_hf_tile_chunk", None)
            continue
        mlp._hf_tile_chunk = chunk
        if "_hf_tile_saved" not in mlp.__dict__:
            _patch_forward(mlp)
    return model


# ------------------------------------------------------------------ offloaded checkpoints
@dataclass
class OffloadStats:
    """Counters of one model's offload hooks: tensors and bytes packed in forwards (a CPU
    tensor counts but stays, an empty one stays uncounted), tensors given back in backwards,
    and those prefetched."""
    packed: int = 0
    packed_bytes: int = 0
    unpacked: int = 0
    prefetched: int = 0


class _Packed:
    """One offloaded tensor: its device, its host copy, and the device copy once prefetched."""
    __slots__ = ("device", "host", "ready", "__weakref__")

    def __init__(self, device, host):
        self.device, self.host, self.ready = device, host, None


class _Offloader:
    """``saved_tensors_hooks`` pair: under non-reentrant checkpointing the only tensors saved
    outside the checkpoint's own hooks are the layer's inputs, so these see exactly those.

    On CUDA both copies run on a side stream (to pinned host memory as the layer starts, back
    when the backward reaches it). With ``prefetch``, giving back layer ``i``'s input also starts
    copying back layer ``i - 1``'s, which the backward needs next. ``copy_cpu`` (tests) makes
    CPU tensors take the same path, with ``clone`` for the copies."""

    def __init__(self, stats: OffloadStats, pin_memory: bool, prefetch: bool = True):
        self.stats, self.pin_memory, self.prefetch = stats, pin_memory, prefetch
        self.copy_cpu = False
        self.streams = {}
        self.order = []  # weak references to the live _Packed, in pack order

    def _stream(self, device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, t: torch.Tensor):
        if t.numel() == 0:  # torch 2.11's checkpoint saves an empty `dummy` beside the inputs
            return t
        self.stats.packed += 1
        self.stats.packed_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu" and not self.copy_cpu:
            return t
        if t.device.type == "cuda":
            stream = self._stream(t.device)
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # t's memory is not reused before the copy is done
        else:
            host = t.to("cpu", copy=True)
        packed = _Packed(t.device, host)
        self.order = [r for r in self.order if r() is not None] + [weakref.ref(packed)]
        return packed

    def _fetch(self, packed: _Packed) -> torch.Tensor:
        if packed.device.type == "cuda":
            with torch.cuda.stream(self._stream(packed.device)):
                return packed.host.to(packed.device, non_blocking=True)
        return packed.host.to(packed.device, copy=True)

    def unpack(self, packed):
        self.stats.unpacked += isinstance(packed, _Packed) or packed.numel() > 0  # as pack counted
        if isinstance(packed, torch.Tensor):
            return packed
        t, packed.ready = packed.ready, None
        self.stats.prefetched += t is not None
        t = self._fetch(packed) if t is None else t
        if packed.device.type == "cuda":  # fetched on the side stream, used on this one
            current = torch.cuda.current_stream(packed.device)
            current.wait_stream(self._stream(packed.device))
            t.record_stream(current)
        where = next((i for i, r in enumerate(self.order) if r() is packed), None)
        previous = self.order[where - 1]() if self.prefetch and where else None
        if where is not None:
            self.order.pop(where)
        if previous is not None and previous.ready is None:
            previous.ready = self._fetch(previous)
        return t


def _wrap_checkpoint_func(layer) -> None:
    """Put the offload hooks around ``layer._gradient_checkpointing_func`` (the checkpoint
    call itself), so they sit outside the checkpoint's own hooks whichever Transformers
    version calls it: 5.2x checkpoints in the layer's ``forward``, 5.17 in ``__call__`` — a
    hook pushed from an instance ``forward`` there would sit inside the checkpoint and take
    every activation of the layer to the host."""
    fn = layer.__dict__.get("_gradient_checkpointing_func")
    if fn is None or hasattr(fn, "_hf_offload_inner"):
        return

    def offloaded(function, *args, **kwargs):
        if (off := layer.__dict__.get("_hf_offloader")) is None or not torch.is_grad_enabled():
            return fn(function, *args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
            return fn(function, *args, **kwargs)

    offloaded._hf_offload_inner = fn
    layer._gradient_checkpointing_func = offloaded


def offload_checkpoints(model, enable: bool = True, *, pin_memory: Optional[bool] = None,
                        prefetch: bool = True):
    """Keep each decoder layer's checkpointed input (``[B, S, hidden]``) in host memory from
    its forward until its backward recompute, instead of on the accelerator.

    Needs non-reentrant gradient checkpointing when the model runs
    (:func:`hf_hilbert_attn.training.enable_checkpointing`, before or after this call); other
    layers are left alone. Exact (values are copied); ``enable=False`` undoes; idempotent.

    ``model``: a Transformers model (or a module containing one), returned changed in place
    (:func:`offload_stats` reads its counters). ``enable``: install or remove the hooks.
    ``pin_memory``: page-locked host buffers (asynchronous copies; default: with CUDA).
    ``prefetch``: copy the next layer's input back while the current layer's backward runs (one
    more ``[B, S, hidden]`` on the device).
    """
    layers = _decoder_layers(model, "offload_checkpoints")
    if not enable:
        for layer in layers:
            fn = layer.__dict__.get("_gradient_checkpointing_func")
            if fn is not None and hasattr(fn, "_hf_offload_inner"):  # ours: the model's back
                layer._gradient_checkpointing_func = fn._hf_offload_inner
            layer.__dict__.pop("_hf_offloader", None)
        if (handle := model.__dict__.pop("_hf_offload_hook", None)) is not None:
            handle.remove()
        return model
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    offloader = _Offloader(offload_stats(model) or OffloadStats(), pin, prefetch)
    for layer in layers:
        layer._hf_offloader = offloader
        _wrap_checkpoint_func(layer)
    if "_hf_offload_hook" not in model.__dict__:
        # checkpointing enabled (again) after this call installs a fresh checkpoint function:
        # wrap it before the layers run
        def wrap_all(module, args):
            for layer in layers:
                _wrap_checkpoint_func(layer)

        model._hf_offload_hook = model.register_forward_pre_hook(wrap_all)
    return model


def offload_stats(model) -> Optional[OffloadStats]:
    """The :class:`OffloadStats` of ``model``'s offload hooks, or None when none are installed."""
    offloaders = (m.__dict__.get("_hf_offloader") for m in model.modules())
    return next((off.stats for off in offloaders if off is not None), None)
