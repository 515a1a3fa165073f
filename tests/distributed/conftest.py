"""Fixtures shared by modules of this folder."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch, shm_buffers

# tests/helpers/trainer_scenarios.py's scenarios, every one in one 2-rank launch for the session:
# test_engine.py reads the engine's, test_nonfinite.py the non-finite guard's.
SCENARIOS = [
    "zero_stages",
    "grad_accum",
    "partial_window",
    "activation_checkpointing",
    "bf16",
    "offload",
    "evaluate_zero3",
    "nonfinite",
]


@pytest.fixture(scope="session")
def trainer_scenarios(tmp_path_factory):
    """The launch's output directory and its results.json; ``shm_left.json`` names the DeepSpeed
    all-reduce buffers the launch left in /dev/shm."""
    out = tmp_path_factory.mktemp("trainer_scenarios")
    before = shm_buffers()
    launch(["tests/helpers/trainer_scenarios.py", str(out), *SCENARIOS], launcher="torchrun")
    (out / "shm_left.json").write_text(json.dumps(sorted(shm_buffers() - before)))
    return out, json.loads((out / "results.json").read_text())
