"""Benchmarks that ship with the package: the attention-op benchmark (:mod:`.attention`,
``hf-hilbert-attn bench attention``; its rows :mod:`.impls`, its ``--max-len`` search
:mod:`.max_len`), the baselines it compares against (:mod:`.baselines`:
gather → SDPA → LSE merge, FlexAttention) and the helpers every benchmark script shares
(:mod:`.common`: timing, memory, CSV / PNG / markdown). The end-to-end model benchmark is
:mod:`hf_hilbert_attn.tools.evaluation.bench_model`."""
