"""Every decoder family of the installed Transformers, tried as a new user would: a tiny random
model of the family with ``attn_implementation="hilbert_dilated"`` (CPU, float32).

    python examples/model_zoo.py                      # every family: a Markdown table
    python examples/model_zoo.py llama gemma3_text    # some families
    python examples/model_zoo.py --csv zoo.csv --verbose

Families: the model types with a causal-LM class whose modeling code calls Transformers'
attention interface (``ALL_ATTENTION_FUNCTIONS``), text-only variants included. Each gets the
family's config with small sizes (2 layers, hidden 64, 4 query / 2 key-value heads of 16, 128
tokens of vocabulary; again without the head size where the family derives it, then with as many
key-value heads as query heads, as multi-head latent attention expands them; a sliding window of
16 tokens where the family's layers have one, chunks of 16 where they are chunked), random
weights, and 40 tokens. Outcomes:

* ``runs``: the ``dense`` pattern gives the baseline's logits (``rel_diff``: largest difference
  over the largest logit; the baseline is sdpa, or eager where the family offers no sdpa), a
  sparse pattern (windows 8 / 16 / 32 with rates 1 / 2 / 4) gives finite logits and gradients,
  and ``generate()`` makes 4 tokens with a DynamicCache;
* ``refused``: our one-line ``ValueError`` (its text);
* ``not built``: the tiny config, model or baseline could not be made (the family's own error);
* ``crash``: any other error, with where it was raised.

The inventory of a release (``docs/bench/model_zoo/zoo_transformers_<release>_cpu.csv``) is
what the tests check a release against: it must name every family the installed Transformers
has, and a family of each outcome must give its recorded outcome again
(``tests/test_tool_smoke.py``); a new release is held there to the newest earlier inventory for
the families both have, with a warning naming its new ones, until this script is run for it.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import traceback
import warnings

import torch

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, n_embd=64, n_layer=2, n_head=4, n_positions=512,
             moe_intermediate_size=32, num_local_experts=4, num_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
             qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_group=1,
             topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0,
             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, hidden_dropout=0.0,
             attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, dropout=0.0)
SLIDING_WINDOW = 16  # for families whose layers have one (and their chunks)
MAX_PARAMS = 20_000_000  # a family whose model stays larger ignores the small sizes: not built


def families() -> list:
    """Model types with a causal-LM class whose modeling module uses the attention interface."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        module = model_type_to_module_name(name)
        spec = importlib.util.find_spec(f"transformers.models.{module}")
        if spec is None:
            continue
        path = next(iter(spec.submodule_search_locations)) + f"/modeling_{module}.py"
        try:
            with open(path) as f:
                if "ALL_ATTENTION_FUNCTIONS" in f.read():
                    out.append(name)
        except OSError:
            continue
    return out


def _build(name: str, attn: str, sizes: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(name, **sizes)
    if getattr(cfg, "sliding_window", None):  # a window the 40 tokens cross
        cfg.sliding_window = SLIDING_WINDOW
    if getattr(cfg, "attention_chunk_size", None):  # chunks too (Llama 4)
        cfg.attention_chunk_size = SLIDING_WINDOW
    with torch.device("meta"):  # sizes the family ignores must not fill the machine's memory
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if params > MAX_PARAMS:
        raise RuntimeError(f"the small sizes leave {params / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                            dtype=torch.float32).eval()


def _baseline(name: str, ids):
    """(model, its logits, the implementation used) with the first sizes and implementation
    that work."""
    last = None
    derived = {k: v for k, v in SMALL.items() if k != "head_dim"}
    for sizes in (SMALL, derived, dict(derived, num_key_value_heads=4)):
        for attn in ("sdpa", "eager"):
            try:
                model = _build(name, attn, sizes)
                with torch.no_grad():
                    return model, model(ids).logits, attn
            except Exception as e:  # noqa: BLE001 - the family's own limits: reported
                last = e
    raise RuntimeError(f"not built: {type(last).__name__}: {_first_line(last)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else repr(e))[:240]


def try_family(name: str, verbose: bool = False) -> dict:
    """One family's outcome (``families`` docstring at the top)."""
    import hf_hilbert_attn
    from hf_hilbert_attn import DilatedPattern

    row = dict(family=name, outcome="", baseline="", rel_diff="", detail="")
    ids = torch.randint(3, 128, (1, 40))
    try:
        model, expected, row["baseline"] = _baseline(name, ids)
    except RuntimeError as e:
        row.update(outcome="not built", detail=str(e)[len("not built: "):])
        return row
    try:
        model.set_attn_implementation("hilbert_dilated")
        hf_hilbert_attn.configure(model, "dense")
        with torch.no_grad():
            got = model(ids).logits
        row["rel_diff"] = f"{float((got - expected).abs().max() / expected.abs().max()):.1e}"
        hf_hilbert_attn.configure(model, DilatedPattern([8, 16, 32], [1, 2, 4]))
        model.train()
        logits = model(ids).logits
        logits.float().pow(2).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not torch.isfinite(logits).all() or not grads or \
                not all(torch.isfinite(g).all() for g in grads):
            raise RuntimeError("non-finite logits or gradients with a sparse pattern")
        model.eval()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        row["outcome"] = "runs"
    except ValueError as e:
        row.update(outcome="refused", detail=_first_line(e))
    except Exception as e:  # noqa: BLE001 - what a user would see: reported
        where = traceback.extract_tb(e.__traceback__)[-1]
        row.update(outcome="crash", detail=f"{type(e).__name__}: {_first_line(e)} "
                                           f"({where.filename.split('/')[-1]}:{where.lineno})")
        if verbose:
            traceback.print_exc()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="model types (default: every family)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV")
    ap.add_argument("--verbose", action="store_true", help="print the traceback of a crash")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    names = args.families or families()
    rows = []
    print("| family | outcome | baseline | dense ÷ baseline | detail |\n|---|---|---|---|---|")
    for name in names:
        row = try_family(name, args.verbose)
        rows.append(row)
        print(f"| {name} | {row['outcome']} | {row['baseline']} | {row['rel_diff']} | "
              f"{row['detail']} |", flush=True)
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("runs", "refused", "not built", "crash")}
    print("\n" + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(rows)} families")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
