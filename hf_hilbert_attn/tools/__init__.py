"""The tools beside the library: the ``hf-hilbert-attn`` command (:mod:`.cli`), long-context
evaluation and the quality study (:mod:`.evaluation`), benchmarks (:mod:`.benchmarks`), the
fine-tune script (:mod:`.finetune`) and the models it and the
benchmarks build (:mod:`.models`), the kernels' compile check (:mod:`.aot`), pattern pictures
(:mod:`.visualize`) and lm-evaluation-harness with ``hilbert_dilated`` (:mod:`.lm_eval`).

They import the library; the library never imports them. Their own dependencies come with the
``tools`` extra: ``pip install -e ".[tools]"`` in a checkout (or a built wheel with ``[tools]``).
"""
