"""What the tests run and share, kept apart from the tests themselves (pytest collects none of it).

- ``launch``: runs a script under a real launcher (deepspeed, torchrun, accelerate, python).
- ``matrix``: the launch matrix's cases and their runs, launched once per session (``matrix_runs``).
- ``scaffold``: what many tests share around a run: ``tiny_flags`` (a tiny ``scripts/train.py`` run's
  flags, each test's differences as overrides), ``read_metrics`` and its filters (``metrics.jsonl``),
  ``assert_same_weights``/``weights_equal``, ``mounted_tmpfs``/``tmpfs_refusal``, ``bpe_tokenizer``.
- ``trainer_scenarios``: engine and Trainer scenarios on 2 ranks; the tests compare their results.
- ``resume_scenarios``: checkpoint scenarios (exact resume, corruption, world-size change, export).
- ``pipeline_scenarios``: pipeline-parallel scenarios against the same model without a pipeline.
- ``deepspeed_config_parser``: DeepSpeed's own parser run over configs in a one-rank child process.
- ``hf_trainer_script``: an ordinary HF Trainer script; a test runs it with our Trainer import.
- ``hf_features``: HF ``TrainingArguments`` options (label smoothing, NEFTune, ...) through the public
  API, against transformers' Trainer where it is the reference.
- ``run_clm_shaped``: an HF example script in run_clm's shape (argument dataclasses, ``--deepspeed``);
  a test runs it with our import and with transformers' Trainer, and compares their output dirs.
- ``run_mlm_shaped``, ``run_classification_shaped``, ``run_ner_shaped``,
  ``run_image_classification_shaped``, ``run_summarization_shaped``: the other HF example scripts'
  shapes (``hf_example_common``: what they share; ``hf_examples_data``: their tokenizers and data
  files, built locally); ``tests/distributed/test_hf_examples.py`` runs them with each Trainer.
"""
