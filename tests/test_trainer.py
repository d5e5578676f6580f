"""``transformers.Trainer`` with sequence parallelism equals the 1-process Trainer.

One gloo run of 1 process (plain ``Trainer``) and one of 2 processes (``SequenceParallelTrainer``,
``sp_size=2``) train the same tiny random Llama on the same data; every scenario runs in both
(a module fixture, so the whole file starts 3 processes, all at once), and each test checks one property:
losses and every parameter gradient at every step (float32: close, the ring sums in another
order), packed rows through ``DataCollatorWithFlattening``, checkpoint + resume through Trainer
(exact), the one-line errors, and TRL's ``SFTTrainer`` when TRL is installed.
"""

import concurrent.futures
import math
import os
import warnings

import numpy as np
import pytest
import torch

from _dist import run_distributed
from conftest import assert_error_within, model_tol, reorder_tol

pytestmark = pytest.mark.multiprocess

VOCAB = 96
PATTERN = dict(segment_lengths=[8, 32, 64], dilation_rates=[1, 2, 4])


def _model(seed=0, attn="hilbert_dilated", dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_hilbert_attn

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype)
    if attn == "hilbert_dilated":
        hf_hilbert_attn.configure(model, hf_hilbert_attn.DilatedPattern(**PATTERN))
    return model


def _rows(n, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        s = lengths[i % len(lengths)]
        ids = torch.randint(3, VOCAB, (s,), generator=g)
        labels = ids.clone()
        labels[torch.rand(s, generator=g) < 0.2] = -100  # ignored tokens: the count matters
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


class _Grabber:
    """Callback: every optimizer step's gradients (after DDP's all-reduce), one float64 array per
    parameter."""

    def __init__(self):
        from transformers import TrainerCallback

        grabber = self

        class CB(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                grabber.grads.append({n: p.grad.detach().double().numpy()
                                      for n, p in model.named_parameters()})

        self.grads, self.callback = [], CB()


def _args(out, **kw):
    from transformers import TrainingArguments

    # SGD where runs are compared: Adam's first step moves every weight by about lr, whatever the
    # size of its gradient, so float32 rounding of near-zero gradients would grow into visible
    # differences by the next step
    base = dict(output_dir=out, per_device_train_batch_size=2, learning_rate=0.2, optim="sgd",
                max_steps=3,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                disable_tqdm=True, max_grad_norm=0.0, warmup_steps=0, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _trainer(world, **kw):
    from transformers import Trainer

    from hf_hilbert_attn.integrations.trainer import SequenceParallelTrainer

    if world == 1:
        return Trainer(**kw)
    return SequenceParallelTrainer(sp_size=world, **kw)


# ------------------------------------------------------------------------------- scenarios
def _plain(world, tmp, dtype=torch.float32):
    from transformers import default_data_collator

    grab = _Grabber()
    tr = _trainer(world, model=_model(dtype=dtype), args=_args(f"{tmp}/plain{world}{dtype}",
                                                   gradient_accumulation_steps=2,
                                                   per_device_eval_batch_size=2),
                  train_dataset=_rows(12, [61], 1), eval_dataset=_rows(4, [61], 2),
                  data_collator=default_data_collator, callbacks=[grab.callback])
    tr.train()
    ev = tr.evaluate()
    return {"losses": _losses(tr), "grads": grab.grads, "eval_loss": ev["eval_loss"]}


def _packed(world, tmp, dtype=torch.float32):
    from transformers import DataCollatorWithFlattening

    grab = _Grabber()
    # activation checkpointing under SP: the backward recomputes the ring forward
    args = _args(f"{tmp}/packed{world}{dtype}", per_device_train_batch_size=3,
                 gradient_checkpointing=world > 1)
    tr = _trainer(world, model=_model(dtype=dtype), args=args,
                  train_dataset=_rows(12, [13, 29, 40, 7, 22], 3),
                  data_collator=DataCollatorWithFlattening(), callbacks=[grab.callback])
    tr.train()
    return {"losses": _losses(tr), "grads": grab.grads}


def _resume(world, tmp):
    from transformers import default_data_collator

    out = f"{tmp}/resume{world}"
    kw = dict(train_dataset=_rows(12, [61], 4), data_collator=default_data_collator)
    adam = dict(optim="adamw_torch", learning_rate=1e-2, max_steps=4)  # optimizer state to restore
    full = _trainer(world, model=_model(), args=_args(out, save_strategy="steps", save_steps=2,
                                                      **adam), **kw)
    full.train()
    resumed = _trainer(world, model=_model(seed=1), args=_args(out, **adam), **kw)
    try:
        resumed.train(resume_from_checkpoint=f"{out}/checkpoint-2")
    except RuntimeError as e:  # Transformers 5.17 loads the optimizer state of a CPU process
        # group with map_location "cpu:0", which torch.load refuses (later releases do not)
        if "restore data location" not in str(e):
            raise
        return {"unsupported": f"this Transformers cannot resume on CPU processes: {e}"}
    return {"full": _losses(full), "resumed": _losses(resumed),
            "ckpts": sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))}


def _errors(world, tmp):
    """The message of each misconfiguration (None where nothing was raised)."""
    from transformers import default_data_collator

    from hf_hilbert_attn.integrations.trainer import SequenceParallelTrainer

    data = dict(train_dataset=_rows(4, [16], 5), data_collator=default_data_collator)
    if world == 1:
        cases = {"sp2_of_1": lambda: SequenceParallelTrainer(model=_model(), args=_args(f"{tmp}/e"),
                                                             sp_size=2, **data)}
    else:
        cases = {
            "sp3": lambda: SequenceParallelTrainer(model=_model(), args=_args(f"{tmp}/e"), sp_size=3,
                                                   **data),
            "sdpa": lambda: SequenceParallelTrainer(model=_model(attn="sdpa"), args=_args(f"{tmp}/e"),
                                                    sp_size=2, **data),
            "smoothing": lambda: SequenceParallelTrainer(
                model=_model(), args=_args(f"{tmp}/e", label_smoothing_factor=0.1), sp_size=2, **data),
            "tokens": lambda: SequenceParallelTrainer(
                model=_model(), args=_args(f"{tmp}/e", average_tokens_across_devices=False),
                sp_size=2, **data),
            "layout": lambda: SequenceParallelTrainer(model=_model(), args=_args(f"{tmp}/e"),
                                                      sp_size=2, sp_layout="diagonal", **data),
            "mode": lambda: SequenceParallelTrainer(model=_model(), args=_args(f"{tmp}/e"),
                                                    sp_size=2, sp_mode="heads", **data),
        }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _sft(world, tmp, dtype=torch.float32):
    from trl import SFTConfig, SFTTrainer

    from hf_hilbert_attn.tools.evaluation.corpus import build_char_tokenizer
    from hf_hilbert_attn.integrations.trainer import sequence_parallel_trainer

    tok = build_char_tokenizer()
    rows = [{"input_ids": r["input_ids"]} for r in _rows(12, [21, 34, 9, 40], 6)]
    from datasets import Dataset

    args = SFTConfig(output_dir=f"{tmp}/sft{world}{dtype}", per_device_train_batch_size=3,
                     max_steps=3,
                     learning_rate=0.2, optim="sgd", logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, seed=0, disable_tqdm=True, max_grad_norm=0.0,
                     padding_free=True, max_length=None, bf16=False)  # TRL's default is bf16
    cls = SFTTrainer if world == 1 else sequence_parallel_trainer(SFTTrainer)
    kw = {} if world == 1 else {"sp_size": world}
    grab = _Grabber()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = cls(model=_model(dtype=dtype), args=args, train_dataset=Dataset.from_list(rows),
                 processing_class=tok, callbacks=[grab.callback], **kw)
        tr.train()
    return {"losses": _losses(tr), "grads": grab.grads}


def _collator():
    """A collator that gives pre-shifted ``shift_labels`` (and varlen keys) shards like one that
    gives ``labels``; one whose last ``shift_labels`` column is not ignored is refused."""
    from transformers import DataCollatorWithFlattening

    from hf_hilbert_attn.integrations.trainer import FINGERPRINT_KEY, SequenceParallelCollator
    from hf_hilbert_attn.sharding import shift_labels

    rows = _rows(3, [13, 29, 7], 7)
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def pre_shifted(features):
        b = flat(features)
        b["shift_labels"] = shift_labels(b.pop("labels"))
        return b

    out = {"same": [], "varlen_dropped": True}
    for rank in range(2):
        a = SequenceParallelCollator(flat, rank, 2, "zigzag")(rows)
        b = SequenceParallelCollator(pre_shifted, rank, 2, "zigzag")(rows)
        out["varlen_dropped"] &= not any(k.startswith(("cu_seq", "max_length")) for k in a)
        out["same"].append(sorted(a) == sorted(b) and all(
            torch.equal(a[k], b[k]) for k in a if k != FINGERPRINT_KEY))

    def bad(features):
        b = pre_shifted(features)
        b["shift_labels"][..., -1] = 5
        return b

    try:
        SequenceParallelCollator(bad, 0, 2)(rows)
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    return out


def _example(world, tmp):
    """``examples/finetune_trainer.py``'s main() in this process group (what torchrun runs)."""
    import importlib.util
    import json

    from hf_hilbert_attn.tools.evaluation.corpus import builtin_corpus

    text, yaml = f"{tmp}/notes.txt", f"{tmp}/p.yaml"
    if world == 1:  # written once: the 2-process run reads them after its own other scenarios
        with open(text, "w") as f:
            f.write("\n\n".join(builtin_corpus(3000, seed=3)))
        with open(yaml, "w") as f:
            f.write("segment_lengths: [16, 32, 64]\ndilation_rates: [1, 2, 4]\n")
    else:
        import time

        for _ in range(600):  # the 1-process run writes them within its first seconds
            if os.path.exists(yaml):
                break
            time.sleep(0.1)
    spec = importlib.util.spec_from_file_location(
        "finetune_trainer", os.path.join(os.path.dirname(__file__), "..", "examples",
                                         "finetune_trainer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = f"{tmp}/example{world}"
    assert mod.main(["--data", text, "--pattern", yaml, "--seq-len", "64", "--max-steps", "3",
                     "--lr", "0.1", "--output-dir", out]) == 0
    import torch.distributed as dist

    dist.barrier()  # rank 0 writes the log and the tokenizer
    with open(f"{out}/train_log.jsonl") as f:
        losses = [json.loads(line)["loss"] for line in f]
    with open(f"{out}/final/config.json") as f:
        kept = json.load(f)["hilbert_attn"]["segment_lengths"]
    return {"losses": losses, "pattern": kept,
            "tokenizer": os.path.exists(f"{out}/final/tokenizer_config.json")}


def _worker(rank, world, tmp, with_trl):
    # Accelerate reads the launcher's environment to see the process group run_distributed made
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import transformers

    transformers.logging.set_verbosity_error()
    out = {"example": _example(world, tmp), "plain": _plain(world, tmp),
           "packed": _packed(world, tmp), "errors": _errors(world, tmp)}
    if world > 1:
        out["resume"] = _resume(world, tmp)
    else:
        out["collator"] = _collator()
        # the same runs in float64: what both float32 runs approximate (conftest rule 2)
        out["plain64"] = _plain(world, tmp, torch.float64)
        out["packed64"] = _packed(world, tmp, torch.float64)
    if with_trl:
        out["sft"] = _sft(world, tmp)
        if world == 1:
            out["sft64"] = _sft(world, tmp, torch.float64)
    if rank > 0:  # rank 0's results are checked; the others must log the same losses
        out = {k: {"losses": v["losses"]} for k, v in out.items() if "losses" in v}
    return out


def _has_trl():
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("trainer"))
    trl = _has_trl()
    # both runs at once: the 1-process run alone would leave one of two cores idle
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        one = pool.submit(run_distributed, _worker, 1, tmp, trl, timeout=240)
        two = pool.submit(run_distributed, _worker, 2, tmp, trl, timeout=240)
        one, two = one.result()[0], two.result()
    for name, res in two[1].items():  # every rank logs the same (all-gathered) losses
        assert res["losses"] == two[0][name]["losses"], name
    return one, two[0]


# Tokens in an optimizer step's loss, at most: what the loss and every gradient sum over
PLAIN_TOKENS = 2 * 2 * 61  # 2 rows of 61 per micro-batch, 2 accumulated
PACKED_TOKENS = 3 * 40  # 3 rows of at most 40
SFT_TOKENS = 3 * 40  # likewise


def _check_steps(one, two, exact, what, n):
    """Close: same data and weights; the ring and the shard-wise loss add the same float32 terms
    in another order, so the 2-process error against the float64 run is the 1-process run's
    size (conftest rule 2), with a floor of the ``n``-token sum in another order (rule 1)."""
    assert len(one["losses"]) == len(two["losses"]) == len(exact["losses"]) == 3
    for step in range(3):
        at = f"{what}: step {step}"
        assert_error_within("loss", two["losses"][step], one["losses"][step],
                            exact["losses"][step], what=at,
                            floor=reorder_tol(n) * abs(exact["losses"][step]))
    assert len(one["grads"]) == len(two["grads"]) == len(exact["grads"]) == 3
    for step, (g1, g2, g64) in enumerate(zip(one["grads"], two["grads"], exact["grads"])):
        for name, w in g64.items():
            assert_error_within(f"grad of {name}", g2[name], g1[name], w,
                                what=f"{what}: step {step}",
                                floor=reorder_tol(n) * float(np.abs(w).max()))
    assert one["losses"][0] != one["losses"][-1]  # it trained


def test_sp2_trainer_equals_one_process(runs):
    one, two = runs
    _check_steps(one["plain"], two["plain"], one["plain64"], "gradient accumulation 2, padded odd "
                 "length", PLAIN_TOKENS)
    assert_error_within("eval_loss", two["plain"]["eval_loss"], one["plain"]["eval_loss"],
                        one["plain64"]["eval_loss"],
                        floor=reorder_tol(4 * 61) * abs(one["plain64"]["eval_loss"]))


def test_sp2_trainer_packed_rows(runs):
    one, two = runs
    _check_steps(one["packed"], two["packed"], one["packed64"], "DataCollatorWithFlattening",
                 PACKED_TOKENS)


def test_sp2_trainer_checkpoint_resume(runs):
    res = runs[1]["resume"]
    if "unsupported" in res:
        pytest.skip(res["unsupported"])
    assert res["ckpts"] == ["checkpoint-2", "checkpoint-4"]
    # the resumed log holds steps 1-2 from the checkpoint's trainer_state.json, then its own 3-4
    assert len(res["full"]) == 4 and len(res["resumed"]) == 4
    # exact: the model, optimizer, scheduler, RNG and data position come from the checkpoint (the
    # resumed trainer starts from other weights, so nothing passes unless they are loaded)
    assert res["resumed"][2:] == res["full"][2:], (res["resumed"], res["full"])


def test_sp_trainer_errors(runs):
    errors = {**runs[0]["errors"], **runs[1]["errors"]}
    assert errors["sp2_of_1"] is None  # one process: the plain Trainer (docs/trainer.md)
    expect = {"sp3": "sp_size must divide the world size 2, got 3",
              "sdpa": "needs a model loaded with attn_implementation='hilbert_dilated', got 'sdpa'",
              "smoothing": "label_smoothing_factor",
              "tokens": "average_tokens_across_devices=True",
              "layout": "sp_layout must be one of", "mode": "sp_mode must be one of"}
    for name, msg in expect.items():
        assert errors[name] is not None, f"{name}: no error"
        assert msg in errors[name] and "\n" not in errors[name], (name, errors[name])


def test_example_finetune_trainer(runs):
    one, two = runs
    assert len(one["example"]["losses"]) == 3
    # the first step: same weights, the same 63 tokens through rows of at most 64 keys and 64
    # features, summed in another order (conftest.model_tol). Later steps follow AdamW at lr 0.1,
    # which moves a weight whose float32 gradient is within rounding of 0 by up to lr in one run
    # and not the other: not bounded by the arithmetic, so they are only checked to be logged
    # (the SGD runs above compare every step).
    first_one, first_two = one["example"]["losses"][0], two["example"]["losses"][0]
    assert abs(first_two - first_one) <= model_tol(63, 64, 64) * abs(first_one), (
        two["example"]["losses"], one["example"]["losses"])
    assert len(two["example"]["losses"]) == 3 and all(map(math.isfinite, two["example"]["losses"]))
    for res in (one["example"], two["example"]):
        assert res["pattern"] == [16, 32, 64] and res["tokenizer"], res


def test_sp_collator_pre_shifted_labels(runs):
    res = runs[0]["collator"]
    assert res["same"] == [True, True] and res["varlen_dropped"], res
    assert "shift_labels[..., -1] must be -100" in res["bad"], res["bad"]


@pytest.mark.skipif(not _has_trl(), reason="TRL is not installed")
def test_sp2_sft_trainer_equals_one_process(runs):
    one, two = runs
    _check_steps(one["sft"], two["sft"], one["sft64"], "SFTTrainer, padding-free",
                 SFT_TOKENS)
