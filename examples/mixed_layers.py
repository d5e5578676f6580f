"""A model whose layers mix sliding-window and full attention, made from a Llama checkpoint.

Gemma 3, Cohere 2, OLMo 3 and Ministral-style models give most of their layers a short sliding
window and a few full attention. With ``hilbert_dilated``, each sliding layer keeps exactly its
window and only the full-attention layers run the dilated pattern. None of those models can be
downloaded here, so this builds one from weights we have: the Llama checkpoint's weights in a
Ministral model (the same architecture with ``layer_types``), every ``--every``-th layer full and
the others a ``--window``-token window.

    python examples/mixed_layers.py assets/smollm2 assets/smollm2-mixed --window 1024 --every 6
    hf-hilbert-attn show-pattern assets/smollm2-mixed

The new model is not the old one (its sliding layers see less than they were trained on):
compare it with itself under ``sdpa`` (``hf-hilbert-attn quality --model assets/smollm2-mixed``),
before and after a short fine-tune. Within one window it is the source model's function
(checked on a few tokens before saving).
"""

from __future__ import annotations

import argparse

import torch


def convert(src: str, out: str, window: int = 1024, every: int = 6):
    """Save ``src`` (a Llama-architecture model directory) as a Ministral model in ``out`` whose
    layer ``i`` is full attention when ``(i + 1) % every == 0`` and a ``window``-token sliding
    window otherwise; returns the new model. ``ValueError`` for another architecture or a
    window / period below 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MinistralConfig

    if window < 1 or every < 1:
        raise ValueError(f"--window and --every must be >= 1, got {window} and {every}")
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    c = source.config
    if c.model_type != "llama" or getattr(c, "attention_bias", False) or \
            getattr(c, "mlp_bias", False):
        raise ValueError(f"{src}: a Llama model without biases is needed, got {c.model_type}")
    n = c.num_hidden_layers
    config = MinistralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=n, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, sliding_window=window,
        layer_types=["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                     for i in range(n)])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(source.state_dict(), strict=True)
    ids = torch.arange(3, 3 + min(64, window))[None] % c.vocab_size  # inside every window: the
    with torch.no_grad():  # same function as the source, or the weights went to other places
        want = source(ids).logits
        diff = (model(ids).logits - want).abs().max().item()
    if diff > 1e-4 * want.abs().max().item():
        raise RuntimeError(f"the converted model differs from {src} by {diff:.3g}")
    model.save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    except (OSError, ValueError, TypeError):  # a directory without one (tests' tiny models)
        print(f"{src} has no tokenizer: none copied")
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    print(f"wrote {out}: {n} layers, full attention in {full}, the others a {window}-token "
          f"window (the first {ids.shape[1]} tokens: logits within {diff:.3g} of {src}'s)")
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a Llama-architecture model directory")
    ap.add_argument("out", help="where to save the mixed-layer model")
    ap.add_argument("--window", type=int, default=1024, help="sliding window, tokens")
    ap.add_argument("--every", type=int, default=6,
                    help="every N-th layer is full attention (Gemma 3: 6)")
    args = ap.parse_args(argv)
    try:
        convert(args.src, args.out, args.window, args.every)
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
