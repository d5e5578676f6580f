"""Quickstart: a causal LM whose attention is LongNet-style dilated attention.

    python examples/quickstart.py                          # tiny random Llama, the shipped longnet_lm pattern
    python examples/quickstart.py PATH/TO/MODEL [PATTERN.yaml]

Runs a forward over a sequence longer than the pattern's first segment (so the pattern is
sparse there) and a greedy generate() from it, on CPU in seconds with the tiny model.
"""

import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import hf_hilbert_attn  # registers attn_implementation="hilbert_dilated"

ROOT = Path(__file__).resolve().parents[1]


def main():
    model_path = sys.argv[1] if len(sys.argv) > 1 else None
    pattern_path = sys.argv[2] if len(sys.argv) > 2 else ROOT / "hf_hilbert_attn" / "patterns" / "longnet_lm.yaml"
    torch.manual_seed(0)

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="hilbert_dilated")
    else:  # a tiny random Llama with grouped-query attention (4 query heads, 2 key/value heads)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                             max_position_embeddings=16384)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="hilbert_dilated")
    # The pattern goes to model.config.hilbert_attn: save_pretrained keeps it.
    hf_hilbert_attn.configure(model, pattern_path)
    model.eval()
    pattern = hf_hilbert_attn.get_pattern(model.config)

    seq_len = 2 * pattern.segment_lengths[0]  # past the first (dense) segment
    heads = model.config.num_attention_heads
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    dense_pairs = seq_len * (seq_len + 1) // 2 * heads
    pairs = pattern.count_pairs_total(seq_len, heads)
    print(f"pattern: {pattern}")
    print(f"{seq_len} tokens: {pairs / dense_pairs:.1%} of the causal (query, key) pairs are attended")

    with torch.no_grad():
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        t1 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    new = out[0, seq_len:]
    print(f"forward: loss {loss.item():.3f} in {t1 - t0:.2f} s "
          f"(random weights: about ln(vocab) = {torch.log(torch.tensor(float(model.config.vocab_size))):.3f})")
    print(f"generate: {len(new)} new tokens in {t2 - t1:.2f} s: {new.tolist()}")
    if model_path:
        try:
            tok = AutoTokenizer.from_pretrained(model_path)
            print("decoded:", repr(tok.decode(new)))
        except (OSError, ValueError):
            pass


if __name__ == "__main__":
    main()
