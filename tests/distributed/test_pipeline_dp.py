"""2 pipeline stages × 2-way data parallelism on 4 CPU ranks, against 4-way data parallelism."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import assert_same_weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_dp")
    launch(["tests/helpers/pipeline_scenarios.py", str(out), "dp"], nproc=4, launcher="torchrun")
    return out, json.loads((out / "results.json").read_text())["dp"]


@pytest.mark.parametrize("run", ["pipe", "pipe_zero1"])
def test_pipeline_with_data_parallelism_matches(results, run):
    out, res = results
    base = res["base"]["loss"]
    assert len(base) == 10
    assert max(abs(x - y) / y for x, y in zip(res[run]["loss"], base, strict=True)) <= 1e-4
    assert res[run]["ds_config"]["gradient_accumulation_steps"] == 4
    assert res[run]["ds_config"]["train_batch_size"] == res["base"]["ds_config"]["train_batch_size"] == 16
    assert_same_weights(
        out / "dp" / f"{run}.pt", out / "dp" / "base.pt", rtol=1e-4, atol=1e-5, same_keys=False
    )
