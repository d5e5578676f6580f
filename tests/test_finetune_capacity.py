"""finetune's capacity flags: --weights-dtype bfloat16 and --compile (regional)."""
import torch

from hf_hilbert_attn.tools.finetune import build_model, parse_args
from hf_hilbert_attn.tools.finetune_data import ByteTokenizer


def test_weights_dtype_and_compile_flags():
    tok = ByteTokenizer()
    args = parse_args(["--seq-len", "64", "--weights-dtype", "bfloat16", "--compile",
                       "--gradient-checkpointing", "--offload-checkpoints"])
    model, _ = build_model(args, tok)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    layers = model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    # offload wraps the checkpoint call (outside the compiled region)
    assert all(hasattr(layer._gradient_checkpointing_func, "_hf_offload_inner") for layer in layers)

    plain, _ = build_model(parse_args(["--seq-len", "64"]), tok)
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    assert all(layer._compiled_call_impl is None for layer in plain.model.layers)
