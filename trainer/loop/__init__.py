"""The training loop and its HF face: ``Trainer`` (``trainer``), the step plan (``steps``),
evaluation and predictions, callbacks, the nonfinite guard, fault injection, HF's extra methods,
``Seq2SeqTrainer``, and ``build_run`` (``build``), which assembles a run from a ``RunConfig``.
"""
