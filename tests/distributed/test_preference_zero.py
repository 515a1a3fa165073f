"""DPO on 2 ranks under ZeRO-2 and ZeRO-3 (torchrun, one launch of tests/helpers/preference_scenarios.py):
the reference pass scores each rank's share with the partitioned weights, and the run follows the
one-process run of the same global batches step by step."""

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


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_ranks_follow_one_process_and_trl(runs, stage):
    ranks, one = runs
    assert ranks["world_size"] == 2
    for key in METRICS:
        assert ranks[stage][key] == pytest.approx(one["ours"][key], rel=1e-5, abs=1e-6), key
        assert ranks[stage][key] == pytest.approx(one["trl"][key], rel=1e-5, abs=1e-6), key
