"""Calibration: which key/value heads of which layers attend densely (docs/retrieval.md, "Dense
key/value heads"; the rule: hf_hilbert_attn/pattern.py), chosen from synthetic retrieval
prompts and written into the model's config.

    hf-hilbert-attn calibrate MODEL [--budget 0.1] [--method needle_mass|ablation] [--out DIR]

At most ``floor(budget × layers × kv_heads)`` (layer, key/value head) pairs become dense. The
prompts (:func:`calibration_samples`) are passkey and NIAH prompts of :mod:`.ruler`, at lengths
beyond the pattern's first (dense) window and several depths, with their own seed (never the
evaluation's prompts). Two ways to rank the heads:

* ``needle_mass``: one dense pass (SDPA, with a probe in the attention function): each
  (layer, kv head) scores the attention mass that the queries predicting the answer put on the
  needle tokens, averaged over those queries and the query heads of the group, summed over
  prompts. The highest scores become dense. Cost: one forward per batch of prompts.
* ``ablation`` (DuoAttention's question, answered by measurement instead of a fitted gate):
  from the all-sparse model, each (layer, kv head) scores how much the teacher-forced answer
  log-likelihood rises when only that head is dense; the best is added, then (``rescore``)
  the next best few are scored again on top of what was chosen and the best of them added,
  until the budget. Cost: ``1 + candidates + (heads - 1) × rescore + 1`` passes over the
  prompts (the last measures the choice).

The choice is an order: its first ``k`` heads are the choice for every smaller budget
(:meth:`CalibrationResult.per_layer_for`), so one calibration at the largest budget serves all.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# the options live with the console command, which must not import torch to parse them
from ..options import CALIBRATE_METHODS as METHODS, add_calibrate_arguments
from .passkey import _pad_id
from .ruler import RulerGenerator, RulerSample, score_samples

__all__ = ["METHODS", "CALIBRATION_TASKS", "CalibrationResult", "calibrate", "calibration_samples",
           "model_density", "default_lengths", "per_layer_from"]

CALIBRATION_TASKS = ("passkey", "niah_single", "niah_multikey")
CALIBRATION_SEED = 7919  # not the evaluation's seed 0: calibrate and measure on different prompts
CALIBRATION_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
PROBE = "hf_hilbert_needle_probe"  # the attention function of the needle_mass pass


# ----------------------------------------------------------------------------- results
def _shape(config) -> Tuple[int, int, int]:
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    hq = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hkv = getattr(config, "num_key_value_heads", None) or hq
    if not (layers and hq and hkv):
        raise ValueError("cannot read num_hidden_layers / num_attention_heads / "
                         "num_key_value_heads from the model's config")
    return int(layers), int(hq), int(hkv)


def per_layer_from(chosen: Sequence[Tuple[int, int]], layers: int) -> List[List[int]]:
    """``[(layer, kv head), ...]`` → one sorted list of kv heads per layer."""
    out: List[List[int]] = [[] for _ in range(layers)]
    for layer, head in chosen:
        out[layer].append(int(head))
    return [sorted(h) for h in out]


def model_density(config, length: int = 65536) -> float:
    """Allowed causal pairs / dense causal pairs at ``length`` of the model's pattern (its own,
    or the default), over every query head of every layer, dense heads included."""
    from hf_hilbert_attn.integrations.transformers import get_pattern

    layers, hq, hkv = _shape(config)
    dense = hq * length * (length + 1) // 2
    total = sum(get_pattern(config, i).count_pairs_total(length, hq, num_kv_heads=hkv)
                for i in range(layers))
    return total / (layers * dense)


@dataclass
class CalibrationResult:
    """What :func:`calibrate` chose and what it cost.

    ``chosen``: the (layer, kv head) pairs in the order they were chosen; ``per_layer``: the
    choice written into the config (``budget``'s share of ``chosen``); ``scores``:
    ``[layer][kv head]`` of the first pass (needle mass, or the log-likelihood gain of that head
    alone); ``baseline`` / ``final``: mean answer log-likelihood and item accuracy of the
    calibration prompts with no dense head and with the choice (ablation only).
    """

    method: str
    budget: float
    chosen: List[Tuple[int, int]]
    per_layer: List[List[int]]
    scores: List[List[float]]
    density: float
    density_length: int
    seconds: float
    forwards: int
    prompts: int
    prompt_tokens: int
    lengths: List[int] = field(default_factory=list)
    baseline: Dict = field(default_factory=dict)
    final: Dict = field(default_factory=dict)

    def per_layer_for(self, budget: float) -> List[List[int]]:
        """The choice at a smaller ``budget`` (a prefix of :attr:`chosen`)."""
        layers, hkv = len(self.scores), len(self.scores[0]) if self.scores else 0
        return per_layer_from(self.chosen[:budget_heads(budget, layers, hkv)], layers)

    def summary(self) -> str:
        layers, hkv = len(self.scores), len(self.scores[0]) if self.scores else 0
        n = sum(len(h) for h in self.per_layer)
        lines = [f"calibration ({self.method}): {n} of {layers * hkv} key/value heads dense "
                 f"(budget {self.budget:g}); {self.prompts} prompts at "
                 f"{', '.join(str(L) for L in self.lengths)} tokens; {self.forwards} forwards, "
                 f"{self.seconds:.1f} s",
                 f"causal pairs at {self.density_length // 1024}K, all layers: "
                 f"{self.density:.1%}"]
        if self.baseline:
            lines.append(f"calibration prompts: answer log-likelihood {self.baseline['logprob']:.2f}"
                         f" -> {self.final['logprob']:.2f}, items recalled "
                         f"{self.baseline['score']:.0%} -> {self.final['score']:.0%}")
        chosen = " ".join(f"{i}:{h}" for i, h in enumerate(self.per_layer) if h)
        lines.append(f"dense kv heads by layer (layer:[heads]): {chosen or 'none'}")
        return "\n".join(lines)

    def to_dict(self) -> Dict:
        return asdict(self)


def _candidates(config) -> List[Tuple[int, int]]:
    """The (layer, kv head) pairs a calibration may make dense: those of the full-attention
    layers (a sliding-window layer keeps its window)."""
    from hf_hilbert_attn.integrations.model_config import layer_window

    layers, _, hkv = _shape(config)
    return [(i, j) for i in range(layers) if layer_window(config, i) is None for j in range(hkv)]


def budget_heads(budget: float, layers: int, hkv: int) -> int:
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget must be a fraction in [0, 1], got {budget}")
    return int(math.floor(budget * layers * hkv + 1e-9))


# ----------------------------------------------------------------------------- prompts
def dense_window(pattern) -> int:
    """The pattern's dense window: the longest segment of a config with dilation 1 (every
    query sees every key of it). A prompt no longer than that runs the same, sparse or dense:
    it cannot tell heads apart."""
    return max(w for w, r in zip(pattern.segment_lengths, pattern.dilation_rates) if r == 1)


def default_lengths(model, pattern=None) -> Tuple[int, ...]:
    """Two and four times the pattern's first window (where the default pattern stops being
    dense), at most the model's trained length (``max_position_embeddings``).

    ``model``: a model or its config; ``pattern``: default, the config's own."""
    from hf_hilbert_attn.integrations.transformers import get_pattern

    config = getattr(model, "config", model)
    w = (pattern if pattern is not None else get_pattern(config)).segment_lengths[0]
    cap = getattr(config, "max_position_embeddings", None) or 4 * w
    out = tuple(sorted({min(2 * w, cap), min(4 * w, cap)}))
    return out


def calibration_samples(tokenizer, lengths: Sequence[int], *, tasks=CALIBRATION_TASKS,
                        depths: Sequence[float] = CALIBRATION_DEPTHS, trials: int = 1,
                        seed: int = CALIBRATION_SEED, documents=None) -> List[RulerSample]:
    """The calibration prompts: every task × length × depth × trial (with ``seed``)."""
    gen = RulerGenerator(tokenizer, documents=documents, seed=seed)
    return [gen.sample(t, L, float(d), di, k) for t in tasks for L in lengths
            for di, d in enumerate(depths) for k in range(trials)]


# ----------------------------------------------------------------------------- needle mass
class _Probe:
    """State of the ``needle_mass`` pass: which queries and keys to read, and the sums."""

    def __init__(self, layers: int, hkv: int):
        self.mass = torch.zeros(layers, hkv, dtype=torch.float64)
        self.q_index: Optional[torch.Tensor] = None  # [B, m] query positions (padded)
        self.q_valid: Optional[torch.Tensor] = None  # [B, m] bool
        self.needle: Optional[torch.Tensor] = None  # [B, S] float, 1 on needle tokens


_ACTIVE: Optional[_Probe] = None


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """SDPA for the output; on the side, the answer queries' attention mass on the needle.

    ``query [B, Hq, S, D]``, ``key [B, Hkv, S, D]``. Only the ``m`` answer queries' rows of the
    attention matrix are formed: ``[B, Hq, m, S]`` in float32.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, **kwargs)
    probe = _ACTIVE
    if probe is not None and probe.q_index is not None:
        B, hq, S, D = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        idx = probe.q_index.to(query.device)  # [B, m]
        q = query.gather(2, idx[:, None, :, None].expand(B, hq, idx.shape[1], D)).float()
        k = key.float().repeat_interleave(g, dim=1)  # [B, Hq, S, D]
        scale = scaling if scaling is not None else D ** -0.5
        s = torch.einsum("bhmd,bhsd->bhms", q, k) * scale
        future = torch.arange(S, device=query.device)[None, None, :] > idx[:, :, None]  # [B, m, S]
        s = s.masked_fill(future[:, None], float("-inf"))
        p = torch.softmax(s, -1)
        mass = (p * probe.needle.to(query.device)[:, None, None, :]).sum(-1)  # [B, Hq, m]
        valid = probe.q_valid.to(query.device)[:, None, :].float()
        per_q = (mass * valid).sum(-1) / valid.sum(-1).clamp(min=1)  # [B, Hq]
        per_kv = per_q.view(B, hkv, g).mean(-1).sum(0)  # [Hkv], summed over prompts
        probe.mass[module.layer_idx] += per_kv.double().cpu()
    return out


def _register_probe() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, sdpa_mask)


@contextlib.contextmanager
def _attn_implementation(model, name: str):
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@torch.inference_mode()
def _needle_mass(model, samples: Sequence[RulerSample], pad_id: int, max_batch_tokens: int,
                 progress) -> torch.Tensor:
    """``[layers, kv heads]`` needle mass summed over ``samples`` (dense: SDPA)."""
    global _ACTIVE
    layers, _, hkv = _shape(model.config)
    probe = _Probe(layers, hkv)
    _register_probe()
    device = next(model.parameters()).device
    usable = [s for s in samples if s.needle_spans]
    order = sorted(range(len(usable)), key=lambda i: len(usable[i].input_ids))
    per = max(1, max_batch_tokens // max(len(s.input_ids) + len(s.answer_ids) for s in usable))
    with _attn_implementation(model, PROBE):
        _ACTIVE = probe
        try:
            for b in range(0, len(order), per):
                batch = [usable[i] for i in order[b:b + per]]
                T = max(len(s.input_ids) + len(s.answer_ids) for s in batch)
                ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
                needle = torch.zeros(len(batch), T)
                qpos = []
                for r, s in enumerate(batch):
                    seq = s.input_ids + s.answer_ids
                    ids[r, :len(seq)] = torch.tensor(seq)
                    for a, e in s.needle_spans:
                        needle[r, a:e] = 1.0
                    L = len(s.input_ids)
                    qpos.append([L - 1 + t for b0, e0 in s.item_spans for t in range(b0, e0)])
                m = max(len(q) for q in qpos)
                probe.q_index = torch.tensor([q + [q[-1]] * (m - len(q)) for q in qpos])
                probe.q_valid = torch.tensor([[True] * len(q) + [False] * (m - len(q))
                                              for q in qpos])
                probe.needle = needle
                model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1)
                if progress is not None:
                    progress.update(len(batch))
        finally:
            _ACTIVE = None
    return probe.mass / max(1, len(usable))


# ----------------------------------------------------------------------------- ablation
def _measure(model, tokenizer, samples, max_batch_tokens) -> Dict:
    rows = score_samples(model, tokenizer, samples, max_batch_tokens=max_batch_tokens,
                         log_probs=True)
    n = max(1, len(rows))
    return dict(logprob=sum(r["answer_logprob"] for r in rows) / n,
                score=sum(r["score"] for r in rows) / n)


def _ablation(model, tokenizer, samples, k: int, rescore: int, max_batch_tokens: int, progress):
    from hf_hilbert_attn.integrations.transformers import set_dense_kv_heads

    layers, _, hkv = _shape(model.config)
    cands = _candidates(model.config)

    def run(chosen):
        set_dense_kv_heads(model, per_layer_from(chosen, layers))
        res = _measure(model, tokenizer, samples, max_batch_tokens)
        if progress is not None:
            progress.update(1)
        return res

    base = run([])
    alone = {c: run([c]) for c in cands}
    # lazy greedy: a candidate's gain is the one last measured (re-scored ones: on top of the
    # heads chosen when they were re-scored)
    latest = {c: alone[c]["logprob"] - base["logprob"] for c in cands}
    scores = [[latest[(i, j)] for j in range(hkv)] for i in range(layers)]
    chosen: List[Tuple[int, int]] = []
    current = base
    while len(chosen) < k:
        left = sorted((c for c in cands if c not in chosen), key=lambda c: -latest[c])
        if not chosen or rescore <= 0:
            best = left[0]
            current = alone[best] if not chosen else current
        else:
            tried = {}
            for c in left[:rescore]:
                tried[c] = run(chosen + [c])
                latest[c] = tried[c]["logprob"] - current["logprob"]
            best = max(tried, key=lambda c: tried[c]["logprob"])
            current = tried[best]
        chosen.append(best)
    return scores, chosen, base


# ----------------------------------------------------------------------------- entry point
def calibrate(model, tokenizer, *, budget: float = 0.1, method: str = "needle_mass",
              lengths: Optional[Sequence[int]] = None, tasks: Sequence[str] = CALIBRATION_TASKS,
              depths: Sequence[float] = CALIBRATION_DEPTHS, trials: int = 1,
              seed: int = CALIBRATION_SEED, documents=None, rescore: int = 4,
              order_budget: Optional[float] = None, max_batch_tokens: int = 65536,
              density_length: int = 65536, progress: Optional[bool] = None,
              apply: bool = True) -> CalibrationResult:
    """Choose the dense key/value heads of ``model`` (module docstring) and write them into its
    config with :func:`~hf_hilbert_attn.set_dense_kv_heads`.

    Args:
        model: a causal LM with a ``hilbert_dilated`` pattern (its own, or the default); for
            ``ablation`` it should run ``attn_implementation="hilbert_dilated"``.
        tokenizer: its tokenizer.
        budget: at most this fraction of all (layer, kv head) pairs becomes dense.
        method: ``"needle_mass"`` or ``"ablation"``.
        lengths: prompt lengths (default :func:`default_lengths`).
        tasks, depths, trials, seed, documents: the prompts (:func:`calibration_samples`).
        rescore: ablation: candidates scored again after each addition (0: first pass only).
        order_budget: choose heads up to this larger budget (the order serves later slices,
            :meth:`CalibrationResult.per_layer_for`); the config gets ``budget``'s share.
        max_batch_tokens: tokens per forward.
        density_length: the length of the reported density.
        progress: show progress on stderr (default): a tqdm bar on a terminal, else a line
            per stage and at most one every few seconds (:mod:`hf_hilbert_attn.tools.progress`);
            False: nothing.
        apply: write the choice into the config (False: only return it; the model's previous
            dense heads are restored).

    Returns:
        A :class:`CalibrationResult`.
    """
    from hf_hilbert_attn.integrations.transformers import LAYER_DENSE, set_dense_kv_heads

    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {', '.join(METHODS)}, got {method!r}")
    layers, _, hkv = _shape(model.config)
    most = len(_candidates(model.config))  # (sliding-window layers' heads are not candidates)
    k = min(most, budget_heads(budget, layers, hkv))
    k_order = min(most, max(k, budget_heads(order_budget, layers, hkv) if order_budget is not None
                            else 0))
    lengths = list(lengths) if lengths else list(default_lengths(model))
    samples = calibration_samples(tokenizer, lengths, tasks=tasks, depths=depths, trials=trials,
                                  seed=seed, documents=documents)
    previous = (getattr(model.config, "hilbert_attn", None) or {}).get(LAYER_DENSE)
    counter = [0]  # forwards, counted by a hook
    hook = model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    show = True if progress is None else bool(progress)
    t0 = time.perf_counter()
    try:
        chosen, scores, baseline, final = _choose(
            model, tokenizer, samples, method, k, k_order, rescore, max_batch_tokens, show)
    finally:
        hook.remove()
    seconds = time.perf_counter() - t0
    per_layer = per_layer_from(chosen[:k], layers)
    set_dense_kv_heads(model, per_layer)
    density = model_density(model.config, density_length)
    if not apply:
        set_dense_kv_heads(model, previous)
    return CalibrationResult(
        method=method, budget=float(budget), chosen=[tuple(c) for c in chosen],
        per_layer=per_layer, scores=scores, density=density, density_length=density_length,
        seconds=seconds, forwards=counter[0], prompts=len(samples),
        prompt_tokens=sum(len(s.input_ids) for s in samples), lengths=lengths,
        baseline=baseline, final=final)


def _choose(model, tokenizer, samples, method, k, k_order, rescore, max_batch_tokens, show):
    from hf_hilbert_attn.integrations.transformers import set_dense_kv_heads

    from ..progress import progress_bar, stage

    layers, _, hkv = _shape(model.config)
    baseline, final = {}, {}
    if method == "needle_mass":
        with progress_bar(total=sum(1 for s in samples if s.needle_spans),
                          desc="calibrate (needle mass)", unit="prompts",
                          disable=not show, leave=False) as bar:
            mass = _needle_mass(model, samples, _pad_id(tokenizer), max_batch_tokens, bar)
        scores = mass.tolist()
        flat = sorted(_candidates(model.config), key=lambda c: (-scores[c[0]][c[1]], c))
        chosen = flat[:k_order]
    else:
        steps = 1 + len(_candidates(model.config)) + max(0, k_order - 1) * rescore
        set_dense_kv_heads(model, None)
        with progress_bar(total=steps, desc=f"calibrate (ablation, {len(samples)} prompts each)",
                          unit="passes", disable=not show, leave=False) as bar:
            scores, chosen, baseline = _ablation(model, tokenizer, samples, k_order, rescore,
                                                 max_batch_tokens, bar)
        set_dense_kv_heads(model, per_layer_from(chosen[:k], layers))
        stage("calibrate (ablation): measuring the choice (one more pass)", enabled=show)
        final = _measure(model, tokenizer, samples, max_batch_tokens)
    return chosen, scores, baseline, final


# ----------------------------------------------------------------------------- command line
CONFIG_KEY = "hilbert_attn"
REPORT_FILE = "hilbert_calibration.json"


def _patch_config(directory, hilbert_attn: Dict) -> Path:
    import json

    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    cfg[CONFIG_KEY] = hilbert_attn
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def _check_args(args, parser):
    """``(config, pattern, lengths)`` of ``calibrate`` before anything heavy is loaded; a bad
    value is ``parser.error`` (one line, exit 2): a missing model, a budget that makes no head
    dense, lengths inside the pattern's dense window."""
    from transformers import AutoConfig

    from hf_hilbert_attn.integrations.transformers import get_pattern

    from ._args import InputError, check_device, resolve_pattern

    src = Path(args.model)
    if not src.exists():
        parser.error(f"model directory not found: {src} (give a local directory saved with "
                     f"save_pretrained; nothing is downloaded)")
    if not (src / "config.json").is_file():
        parser.error(f"MODEL {src} is not a model directory (no config.json)")
    try:
        check_device(args.device)
        pattern = resolve_pattern(args.pattern)[1] if args.pattern is not None else None
        config = AutoConfig.from_pretrained(str(src))
        layers, _, hkv = _shape(config)
    except (InputError, ValueError, OSError) as e:
        parser.error(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    pattern = pattern if pattern is not None else get_pattern(config)
    if budget_heads(args.budget, layers, hkv) < 1:
        parser.error(f"--budget {args.budget:g} makes no key/value head dense ({layers} layers x "
                     f"{hkv} heads: at least {1 / (layers * hkv):.3g} makes one): nothing to "
                     f"calibrate")
    window = dense_window(pattern)
    short = [L for L in (args.lengths or ()) if L <= window]
    if short:
        parser.error(f"--lengths {' '.join(map(str, short))}: a prompt at or below the "
                     f"pattern's dense window ({window} tokens) runs the same with every head "
                     f"sparse or dense, so it cannot tell heads apart; give lengths above "
                     f"{window} (default: {' '.join(map(str, default_lengths(config, pattern)))})")
    return config, pattern, list(args.lengths or default_lengths(config, pattern))


def run_from_args(args, parser) -> int:
    """``hf-hilbert-attn calibrate``: load, calibrate, write the config (module docstring)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_hilbert_attn import configure

    from ..progress import stage

    config, pattern, lengths = _check_args(args, parser)
    src = Path(args.model)
    show = not args.no_progress
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    out = Path(args.out) if args.out else src
    in_place = out.resolve() == src.resolve()
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    try:  # prompts that cannot be built are a bad value: said before the model is loaded
        calibration_samples(tokenizer, lengths, trials=1)
    except ValueError as e:
        parser.error(f"--lengths {' '.join(map(str, lengths))}: {e}")
    stage(f"calibrate: loading {src} ({device.type}, {str(dtype).replace('torch.', '')})",
          enabled=show)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype,
                                                 attn_implementation="hilbert_dilated")
    if args.pattern is not None:
        configure(model, pattern)
    model.to(device).eval()
    stage(f"calibrate: {args.method}, budget {args.budget:g}, prompts at "
          f"{', '.join(map(str, lengths))} tokens", enabled=show)
    res = calibrate(model, tokenizer, budget=args.budget, method=args.method,
                    lengths=lengths, trials=args.trials, rescore=args.rescore,
                    max_batch_tokens=args.batch_tokens, progress=show)
    print(res.summary())
    if not in_place:
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():  # MODEL's files as they are (weights in their own dtype)
            if f.is_file():
                shutil.copy2(f, out / f.name)
    path = _patch_config(out, model.config.hilbert_attn)
    (out / REPORT_FILE).write_text(json.dumps(res.to_dict(), indent=1) + "\n")
    how = (f"in place: only its {CONFIG_KEY!r} entry changed" if in_place
           else f"a calibrated copy of {src}")
    print(f"wrote {path} ({how}) and {out / REPORT_FILE}")
    print(f"load it with from_pretrained({str(out)!r}, attn_implementation='hilbert_dilated')")
    return 0
