"""A mixture-of-experts model of a class no list knows (tests/helpers/moe_scenario.py: a Llama whose
MLPs route each token to one of eight experts in a ``ModuleList``), through the public API.

Two ranks under torchrun at ZeRO 0, 3 and 2, each stepping on micro-batches of 2 rows, and one
process accumulating 4 micro-batches of one row at ZeRO 0, 3 and 2 beside them, which sees the same
rows in each step. The router's load-balancing loss is on: each row pools its own tokens, so the
grouping of rows into micro-batches and ranks changes nothing. The ranks' tokens pick different
experts, so under ZeRO-3 each expert's gather is asked for by some ranks only: without the block
marked as a leaf (gathered whole) the launch fails on a collective mismatch. ZeRO-2 reduces
gradients in the order they arrive, which then differs between ranks: on two ranks it is refused,
naming the block, and the two ranks' ZeRO-3 run is held to one process's ZeRO-2 run instead.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.launch import launch, together

pytestmark = pytest.mark.distributed

SCRIPT = "tests/helpers/moe_scenario.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def run(ranks: int, batch: int, grad_acc: int, *stages: int) -> dict:
        out = tmp_path_factory.mktemp(f"experts_{ranks}")
        launcher = "torchrun" if ranks > 1 else "python"
        launch(
            [SCRIPT, str(out), str(batch), str(grad_acc), *map(str, stages)], nproc=ranks, launcher=launcher
        )
        return {stage: json.loads((out / f"zero{stage}.json").read_text()) for stage in stages}

    two, one = together(lambda: run(2, 2, 1, 0, 3, 2), lambda: run(1, 1, 4, 0, 3, 2))
    return {2: two, 1: one}


def test_the_ranks_ran_different_experts(results):
    """What makes the gathers differ between ranks (else the test below would prove nothing)."""
    first, second = results[2][3]["experts_ran"]
    assert first != second, (first, second)


@pytest.mark.parametrize(("stage", "one_process_stage"), [(0, 0), (3, 3), (3, 2)])
def test_two_ranks_follow_one_process(results, stage, one_process_stage):
    two, one = results[2][stage], results[1][one_process_stage]
    assert len(two["loss"]) == len(one["loss"]) == 3
    for key in ("loss", "aux_loss", "grad_norm"):
        for a, b in zip(two[key], one[key], strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, two[key], one[key])


def test_zero3_gathers_the_block_whole(results):
    assert results[2][3]["leaves"] == ["RoutedMLP"]
    assert results[2][0]["leaves"] == []


def test_zero2_on_two_ranks_is_refused_naming_the_block(results):
    refused = results[2][2]["refused"]
    assert refused.startswith("zero_optimization.stage: model.layers.0.mlp (RoutedMLP) runs a subset"), (
        refused
    )
    assert refused.endswith("use zero_stage 0 or 3"), refused
