"""The names of what a run writes at the top of ``output_dir`` (the contract in DESIGN.md): one home,
so the writers, the readers and the tools agree. Checkpoint directories' own layout lives with them
(``trainer.checkpoint.store``)."""

from __future__ import annotations

DS_CONFIG = "ds_config.json"  # the resolved DeepSpeed config the run used
RUN_CONFIG = "run_config.yaml"  # the whole run's arguments, as a recipe that reproduces it
METRICS = "metrics.jsonl"  # one JSON row per logging step and evaluation
FINAL = "final"  # the HF export of the finished run
