"""Any model HF's Trainer trains, through the public API: sequence classification (single label,
multi-label, regression), token classification, masked LM, an encoder-decoder and an image
classifier, each on its own ``outputs.loss`` with HF's accumulation semantics.

Two launches of tests/helpers/any_model_scenario.py, each running every stage's tasks in turn: two
ranks under torchrun and one plain process with twice the accumulation steps, which sees the same one-row micro-batches in every
step. Every task runs under ZeRO-3 on both; ZeRO 0, 1 and 2 run the classification tasks. The
per-step losses and gradient norms, and the evaluation loss, must agree.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.any_model_scenario import TASKS
from tests.helpers.launch import launch, together

pytestmark = pytest.mark.distributed

SCRIPT = "tests/helpers/any_model_scenario.py"
STAGES = {3: TASKS, 0: ["single_label"], 1: ["regression"], 2: ["multi_label", "image_classification"]}
RUNS = [(stage, name) for stage, names in STAGES.items() for name in names]
PREDICTIONS = {  # predict() on 5 rows: the predictions' and labels' shapes, as HF's Trainer gives them
    "single_label": ([5, 3], [5]),
    "multi_label": ([5, 3], [5, 3]),
    "regression": ([5, 1], [5]),
    "token_classification": ([5, 11, 5], [5, 11]),
    "masked_lm": ([5, 11, 48], [5, 11]),
    "image_classification": ([5, 4], [5]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    specs = [f"{stage}:{','.join(names)}" for stage, names in STAGES.items()]

    def run(ranks: int, grad_acc: int) -> dict:
        out = tmp_path_factory.mktemp(f"any_model_{ranks}")
        launch(
            [SCRIPT, str(out), str(grad_acc), *specs],
            nproc=ranks,
            launcher="torchrun" if ranks > 1 else "python",
        )
        return {run: json.loads((out / f"{run[1]}-zero{run[0]}.json").read_text()) for run in RUNS}

    two, one = together(lambda: run(2, 2), lambda: run(1, 4))  # the one process beside the two ranks
    return {2: two, 1: one}


@pytest.mark.parametrize(("stage", "name"), RUNS, ids=[f"{n}-zero{s}" for s, n in RUNS])
def test_two_ranks_follow_one_process(results, stage, name):
    two, one = results[2][(stage, name)], results[1][(stage, name)]
    assert len(two["loss"]) == len(one["loss"]) == 3
    for key in ("loss", "grad_norm"):
        for a, b in zip(two[key], one[key], strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, two[key], one[key])
    assert math.isclose(two["eval_loss"], one["eval_loss"], rel_tol=1e-5)
    assert all(math.isfinite(x) and x > 0 for x in two["loss"] + two["grad_norm"])


@pytest.mark.parametrize("name", sorted(PREDICTIONS))
def test_predictions_have_hfs_shapes(results, name):
    run = results[2][(3, name)]
    assert (run["prediction_shape"], run["label_shape"]) == tuple(map(list, PREDICTIONS[name]))


def test_the_models_learn(results):
    """Three steps at a high learning rate move every task's loss (an update that never reached the
    weights would log the same loss three times)."""
    for (stage, name), run in results[2].items():
        assert len(set(run["loss"])) == 3, (stage, name, run["loss"])
