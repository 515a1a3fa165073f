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


@pytest.mark.parametrize("run", ["zero2", "zero3", "zero3_half", "zero3_layers"])
def test_two_ranks_match_trl_under_ddp(ranks, run):
    """ZeRO-3 generates with the weights gathered once (zero3), half of them gathered once and the
    rest by each forward (zero3_half), or all by each forward (zero3_layers): the same completions,
    rewards, losses and grad norms as ZeRO-2 and TRL's."""
    assert ranks["world_size"] == 2
    for key in METRICS:
        assert ranks[run][key] == pytest.approx(ranks["trl"][key], rel=1e-5, abs=1e-6), key
        assert ranks[run][key] == pytest.approx(ranks["zero2"][key], rel=1e-5, abs=1e-6), key
    assert ranks["trl"]["reward"][0] != ranks["trl"]["reward"][1]  # the rollouts change step to step


def test_zero3_gathers_for_generation_what_the_budget_holds(ranks):
    """(bytes gathered once, whole bytes) at the last rollout: all of a model that fits; with
    ``generation_gather_gb`` at half the model, the parameters in order up to half; none when
    ``ds3_gather_for_generation`` is off; nothing partitioned under ZeRO-2. At every forward of every
    generation, before ZeRO-3's hooks fetch, the first parameter is whole where it is kept gathered,
    and the last is whole only where the whole model is."""
    kept, whole = ranks["zero3"]["gathered"]
    assert kept == whole > 0
    half, whole_again = ranks["zero3_half"]["gathered"]
    assert whole_again == whole
    assert 0.25 * whole < half <= 0.5 * whole + 1e3  # the budget is half the safetensors file
    assert ranks["zero3_layers"]["gathered"] == [0, whole]
    assert ranks["zero2"]["gathered"] == [0, 0]
    # (first, last) at each forward; one not held may be in flight already (ZeRO-3's prefetch).
    held = {run: {(first == "AVAILABLE", last == "AVAILABLE") for first, last in ranks[run]["generation_status"]}
            for run in ("zero3", "zero3_half", "zero3_layers")}  # fmt: skip
    assert held == {"zero3": {(True, True)}, "zero3_half": {(True, False)}, "zero3_layers": {(False, False)}}
    assert ranks["zero2"]["generation_status"] == []
