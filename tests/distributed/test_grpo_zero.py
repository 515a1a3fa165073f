"""GRPO on 2 ranks (torchrun, one launch of tests/helpers/grpo_scenarios.py): TRL's trainer under
DDP and ours at ZeRO-2 and ZeRO-3, on the same global batch, each rank its share. Each rank samples
from its own seed, as TRL's, so both generate the same completions."""

from __future__ import annotations

import json

import pytest

from tests.helpers.grpo_scenarios import METRICS
from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed
SCRIPT = "tests/helpers/grpo_scenarios.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_zero")
    launch([SCRIPT, str(out), "grpo_ranks"], launcher="torchrun", timeout=900)
    return json.loads((out / "grpo_ranks.json").read_text())


@pytest.mark.parametrize("run", ["zero2", "zero3", "zero3_layers"])
def test_two_ranks_match_trl_under_ddp(ranks, run):
    """ZeRO-3 generates with the weights gathered once (zero3) or gathered by each forward
    (zero3_layers): the same completions, rewards, losses and grad norms as ZeRO-2 and TRL's."""
    assert ranks["world_size"] == 2
    for key in METRICS:
        assert ranks[run][key] == pytest.approx(ranks["trl"][key], rel=1e-5, abs=1e-6), key
        assert ranks[run][key] == pytest.approx(ranks["zero2"][key], rel=1e-5, abs=1e-6), key
    assert ranks["trl"]["reward"][0] != ranks["trl"]["reward"][1]  # the rollouts change step to step
