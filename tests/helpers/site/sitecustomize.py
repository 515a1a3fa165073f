"""Loaded by every Python process the tests start (``run_env`` puts this directory on PYTHONPATH):
processes that never import this package, the ``deepspeed`` launcher's two and the reference runs of
transformers' and TRL's own Trainers, get its guard against DeepSpeed's autotuner importing mlflow
(``trainer.runtime.import_guard``), 2.2 CPU-seconds each here. The tests never run the autotuner.
The launchers' own processes, which import torch or DeepSpeed only to start the ranks and wait on
them, run without the cyclic collector: ``deepspeed --help`` took 2.0-2.2 CPU-seconds with it and
1.5-1.9 without. The others collect every 100,000 allocations instead of 700: transformers' and TRL's
Trainers, and the tests' scripts written as a user's, import torch and transformers at their top,
outside this package's ``heavy_imports()`` (importing transformers' Trainer took 5.6-6.1 CPU-seconds
with the default and 4.6-4.7 with the collector off). Under ``make test-cpu`` it also loads the CPU
accounting this module shadows."""

import gc
import importlib.util
import os
import sys
from pathlib import Path

from trainer.runtime import import_guard

import_guard.install()

LAUNCHERS = {"deepspeed", "torchrun", "accelerate"}  # console scripts; and their rank starters' modules:
LAUNCHER_MODULES = {"deepspeed.launcher.launch", "torch.distributed.run"}
_argv = sys.orig_argv[1:]
_module = _argv[_argv.index("-m") + 1] if "-m" in _argv[:-1] else None
if Path(_argv[0] if _argv else "").name in LAUNCHERS or _module in LAUNCHER_MODULES:
    gc.disable()
else:
    gc.set_threshold(100_000, 50, 100)

if os.environ.get("SUITE_CPU_LOG"):
    _ACCOUNT = Path(__file__).resolve().parents[3] / "scripts" / "cpu_account" / "sitecustomize.py"
    _spec = importlib.util.spec_from_file_location("cpu_account", _ACCOUNT)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
