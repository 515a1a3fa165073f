"""DPO on 2 ranks under ZeRO-2, and under ZeRO-3 with two accumulated micro-batches (torchrun, one
launch of tests/helpers/preference_scenarios.py): the reference pass scores each rank's share with
the partitioned weights, and both runs follow the one-process run of the same global batches, and
TRL's, step by step."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch
from tests.helpers.preference_scenarios import METRICS

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/preference_scenarios.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("preference_zero")
    launch([SCRIPT, str(out), "zero_stages"], launcher="torchrun", timeout=900)
    launch([SCRIPT, str(out), "sigmoid_text"], launcher="python", timeout=900)
    return json.loads((out / "zero_stages.json").read_text()), json.loads(
        (out / "sigmoid_text.json").read_text()
    )


@pytest.mark.parametrize("stage", ["zero2", "zero3_accumulated"])
def test_two_ranks_follow_one_process_and_trl(runs, stage):
    ranks, one = runs
    assert ranks["world_size"] == 2
    for key in METRICS:
        first = (
            1 if key == "rewards/accuracies" else 0
        )  # step 1's margins are 0 up to rounding (test_preference.py)
        assert ranks[stage][key][first:] == pytest.approx(one["ours"][key][first:], rel=1e-5, abs=1e-6), key
        assert ranks[stage][key][first:] == pytest.approx(one["trl"][key][first:], rel=1e-5, abs=1e-6), key
