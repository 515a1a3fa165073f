"""DeepSpeed's autotuner does not import mlflow under this package; everyone else still can. The
package's doors import torch and what stands on it with the cyclic collector paused, then freeze it."""

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


COLLECTOR = """
import atexit, gc, runpy, sys
{before}
atexit.register(lambda: print(gc.isenabled(), gc.get_freeze_count(), gc.get_stats()[2]["collections"]))
{door}
"""
API = "from trainer import Trainer"
TRAIN = (  # refused once the run's modules are in: the checkpoint to resume from is not there
    "sys.argv = ['scripts/train.py', '--output_dir', sys.argv[1], '--resume_from_checkpoint', sys.argv[1]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def collector_after(door: str, *args: str, before: str = "") -> tuple[bool, int, int]:
    """(collector on, objects frozen, full collections) as a process that went through ``door`` exits."""
    probe = COLLECTOR.format(before=before, door=door)
    env = run_env(PYTHONPATH=str(ROOT))  # the collector as a user's process has it: no tests' sitecustomize
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    words = proc.stdout.split()
    assert len(words) >= 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    enabled, frozen, full = words[-3:]
    return enabled == "True", int(frozen), int(full)


def test_the_api_and_the_train_command_load_torch_without_collecting_and_freeze_it(tmp_path):
    enabled, frozen, full = collector_after(API)
    assert enabled and frozen > 100_000 and full == 0  # about 460,000 objects; 7 full collections unpaused
    enabled, frozen, _ = collector_after(TRAIN, str(tmp_path / "missing"))
    assert enabled and frozen > 100_000


def test_a_collector_the_user_turned_off_stays_off_and_nothing_is_frozen():
    assert collector_after(API, before="gc.disable()") == (False, 0, 0)
