"""A left-padded row against the same row alone, on a real model (issue 27's first item).

    python examples/benchmarks/padded_batch.py MODEL_DIR --attn hilbert_dilated --text README.md

Batches a 2,600-token row with a shorter one left-padded to the same length (no position_ids,
as `model(**tok(batch, padding=True))` sends them) and prints the largest logit difference of
the short row against itself alone, and both perplexities. SDPA's difference is the floor
(rounding in another reduction order). ``--pattern``: the ``hilbert_dilated`` pattern instead
of the model's own (``hf_hilbert_attn.configure``).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_hilbert_attn  # registers hilbert_dilated


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--attn", default="hilbert_dilated")
    ap.add_argument("--pattern", default=None,
                    help="hilbert_dilated pattern: a shipped name, a YAML file or inline W:R "
                         "(default: the model's own)")
    ap.add_argument("--text", default="README.md", help="any long text file")
    ap.add_argument("--long", type=int, default=2600)
    ap.add_argument("--short", type=int, default=2200)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn,
                                                 dtype=torch.float32).eval()
    if args.pattern is not None:
        if args.attn != "hilbert_dilated":
            ap.error("--pattern is for --attn hilbert_dilated")
        from hf_hilbert_attn.tools.evaluation import resolve_pattern

        hf_hilbert_attn.configure(model, resolve_pattern(args.pattern)[1])
    text = open(args.text).read()
    ids = tok(text * (1 + 4 * args.long // max(1, len(text))), return_tensors="pt").input_ids[0]
    a, b = ids[:args.long], ids[100:100 + args.short]
    batch = torch.full((2, len(a)), tok.pad_token_id or 0)
    mask = torch.zeros(2, len(a), dtype=torch.long)
    batch[0], mask[0] = a, 1
    batch[1, -len(b):], mask[1, -len(b):] = b, 1
    with torch.no_grad():
        got = model(batch, attention_mask=mask).logits[1, -len(b):]
        alone = model(b[None]).logits[0]

    def ppl(logits):
        return torch.nn.functional.cross_entropy(logits[:-1], b[1:]).exp().item()

    diff = (got - alone).abs().max().item()
    print(f"{args.attn}: left-padded row vs alone: max |logit diff| "
          f"{diff:.4g}; perplexity batched {ppl(got):.3f}, "
          f"alone {ppl(alone):.3f}")
    return dict(max_logit_diff=diff, ppl_batched=ppl(got), ppl_alone=ppl(alone))


if __name__ == "__main__":
    main()
