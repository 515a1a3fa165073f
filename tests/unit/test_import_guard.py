"""DeepSpeed's autotuner does not import mlflow under this package; everyone else still can."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, run_env

PROBE = """
import sys
import trainer.cli.train_job
import deepspeed.autotuning.autotuner as autotuner
print(autotuner.has_mlflow, "mlflow" in sys.modules)
import mlflow
print(mlflow.__name__)
"""


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_a_rank_starts_without_mlflow_and_report_to_still_imports_it():
    # Without the tests' sitecustomize (run_env's PYTHONPATH), which installs the same guard.
    env = run_env(PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False", "mlflow"]
