"""The non-finite guard under each policy: a NaN loss injected at step 6, checkpoints every 4 (a
scenario of the ``trainer_scenarios`` launch in conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed


@pytest.fixture
def nan_runs(trainer_scenarios):
    return trainer_scenarios[1]["nonfinite"]


def test_skip_drops_the_update_and_trains_on(nan_runs):
    run = nan_runs["skip"]
    assert run["exit"] == 0 and run["steps"] == 10
    assert run["nonfinite_windows"] == 1 and run["weights_finite"] is True
    assert run["losses"][2] is None  # the window with step 6 logged NaN (as null)
    assert run["losses"][-1] is not None and run["losses"][-1] < run["losses"][0]
    assert "checkpoint-8" in run["checkpoints"]


def test_rollback_reloads_the_last_checkpoint_with_a_lower_lr(nan_runs):
    run = nan_runs["rollback"]
    assert run["exit"] == 0 and run["steps"] == 10
    assert run["rollbacks"] == 1 and run["lr_scale"] == 0.5
    assert run["weights_finite"] is True
    # The rows after the rollback carry the halved rate (constant schedule at 3e-3).
    assert run["lrs"][-1] == pytest.approx(1.5e-3)
    assert all(x is not None for x in run["losses"][-2:])


def test_stop_exits_with_its_code_and_saves_nothing_non_finite(nan_runs):
    run = nan_runs["stop"]
    assert run["exit"] == run["expected"] == 77
    assert run["checkpoints"] == ["checkpoint-4"]
