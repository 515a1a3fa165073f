"""Loaded by every Python process the tests start (``run_env`` puts this directory on PYTHONPATH):
processes that never import this package, the ``deepspeed`` launcher's two and the reference runs of
transformers' and TRL's own Trainers, get its guard against DeepSpeed's autotuner importing mlflow
(``trainer.runtime.import_guard``), 2.2 CPU-seconds each here. The tests never run the autotuner.
Under ``make test-cpu`` it also loads the CPU accounting this module shadows."""

import importlib.util
import os
from pathlib import Path

from trainer.runtime import import_guard

import_guard.install()

if os.environ.get("SUITE_CPU_LOG"):
    _ACCOUNT = Path(__file__).resolve().parents[3] / "scripts" / "cpu_account" / "sitecustomize.py"
    _spec = importlib.util.spec_from_file_location("cpu_account", _ACCOUNT)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
