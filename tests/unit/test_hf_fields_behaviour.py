"""HF ``TrainingArguments`` fields that are honoured, shown by their effect next to transformers' own
Trainer on the same tiny Llama, rows and seed: ``data_seed``, ``dataloader_drop_last`` (in training,
evaluation and prediction),
``adam_epsilon``, ``prediction_loss_only``, ``full_determinism``, ``ddp_timeout``, ``log_level``,
``log_level_replica`` and ``do_predict``.

Every scenario runs in one child process (tests/helpers/hf_fields_scenario.py, plain python, one
rank), about half a minute in all.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tests.helpers.hf_fields_scenario import WEIGHTS
from tests.helpers.launch import launch
from tests.helpers.scaffold import assert_same_weights

SCRIPT = "tests/helpers/hf_fields_scenario.py"
# Both Trainers run the same fp32 kernels on the same batches; what is left is the order of a few
# float sums (ours adds the loss up per token in float64).
REL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_fields")
    launch([SCRIPT, str(out)], launcher="python", timeout=900)
    return json.loads((out / "results.json").read_text()) | {"out": out}


def close(ours: list[float], theirs: list[float], rel: float = REL) -> bool:
    return len(ours) == len(theirs) > 0 and all(
        abs(a - b) <= rel * abs(b) for a, b in zip(ours, theirs, strict=True)
    )


def test_data_seed_orders_the_data_as_hfs_and_leaves_the_seed_alone(results):
    """data_seed=7: the batches are HF's (the same rows in the same order, the same losses), and not
    the order seed 0 gives; the torch RNG after the Trainer is built is seed 0's either way."""
    run = results["data_seed"]
    ours, hf, plain = run["ours-7"], run["hf-7"], run["ours-none"]
    assert ours["batches"] == hf["batches"], run
    assert close(ours["loss"], hf["loss"]), run
    assert ours["batches"] != plain["batches"], run
    assert ours["draw"] == hf["draw"] == plain["draw"], run


def test_ddp_timeout_reaches_the_process_group(results):
    assert results["data_seed"]["ddp_timeout"] == 1234


def test_dataloader_drop_last_drops_the_partial_batch_as_hfs(results):
    """One epoch of 10 rows in batches of 4: 3 steps (the last of 2 rows) kept, 2 dropped; each
    with HF's batches, losses and grad norms."""
    runs = results["dataloader_drop_last"]
    for drop, steps, last in (("False", 3, 2), ("True", 2, 4)):
        ours, hf = runs[drop]["ours"], runs[drop]["hf"]
        assert ours["steps"] == hf["steps"] == steps, (drop, ours, hf)
        assert len(ours["batches"][-1]) == last and ours["batches"] == hf["batches"], (drop, ours, hf)
        for key in ("loss", "grad_norm"):
            assert close(ours[key], hf[key]), (drop, key, ours, hf)


def test_dataloader_drop_last_applies_to_evaluate_and_predict_as_hfs(results):
    """10 evaluation rows in batches of 4: HF's evaluate and predict drop the last batch of 2 too.
    The same batches and number of predicted rows as HF's; the loss (token-weighted for a causal LM,
    where HF's weights each batch by its rows) is then the loss of the first 8 rows, in evaluate
    and predict alike, and each Trainer's differs from its own loss over all 10."""
    runs = results["dataloader_drop_last_eval"]
    for drop, rows in (("False", 10), ("True", 8)):
        ours, hf = runs[drop]["ours"], runs[drop]["hf"]
        assert ours["batches"] == hf["batches"] and sum(map(len, ours["batches"])) == rows, (drop, ours, hf)
        assert ours["predicted_rows"] == hf["predicted_rows"] == rows, (drop, ours, hf)
        for run in (ours, hf):
            assert close([run["predict_loss"]], [run["eval_loss"]]), (drop, run)
            assert (run["eval_loss"] == pytest.approx(run["first_8_loss"], rel=REL)) == (drop == "True"), run


def test_adam_epsilon_reaches_the_optimizer_and_the_update_as_hfs(results):
    """adam_epsilon=0.1: the optimizer's param groups hold it; losses, grad norms and the final
    weights are HF's, and differ from the default eps's from the second step on."""
    run = results["adam_epsilon"]
    ours, hf, default = run["ours"], run["hf"], run["default"]
    assert ours["eps"] == hf["eps"] == [0.1] and default["eps"] == [1e-8], run
    for key in ("loss", "grad_norm"):
        assert close(ours[key], hf[key]), (key, run)
    assert abs(ours["loss"][1] - default["loss"][1]) > 1e-2, run
    out = results["out"] / "eps"
    assert_same_weights(out / "ours" / WEIGHTS, out / "hf" / WEIGHTS, rtol=1e-4, atol=1e-6)


def test_prediction_loss_only_keeps_predictions_out_as_hfs(results):
    """prediction_loss_only: evaluate() and predict() return the loss alone (no compute_metrics
    call, no predictions or labels), as HF's; without it both give them. HF's keys but its
    model-preparation timing; the loss is per target token here (docs/observability.md), HF's a
    mean of batch means, so the two agree to 1e-3 on these padded batches."""
    runs = results["prediction_loss_only"]
    for only, shapes, calls in (("True", None, 0), ("False", [6, 15], 2)):
        ours, hf = runs[only]["ours"], runs[only]["hf"]
        assert ours["compute_metrics_calls"] == hf["compute_metrics_calls"] == calls, (only, ours, hf)
        assert ours["label_ids"] == hf["label_ids"] == shapes, (only, ours, hf)
        assert (ours["predictions"] is None) == (shapes is None) and ours["predictions"] == hf["predictions"]
        for split in ("eval", "test"):
            theirs = {k: v for k, v in hf[split].items() if "model_preparation_time" not in k}
            assert ours[split].keys() == theirs.keys(), (only, split, ours, hf)
            loss = f"{split}_loss"
            assert close([ours[split][loss]], [theirs[loss]], rel=1e-3), (only, split, ours, hf)
    assert runs["True"]["ours"]["eval"]["eval_loss"] == runs["False"]["ours"]["eval"]["eval_loss"]


def test_full_determinism_switches_torch_as_hfs(results):
    """full_determinism: deterministic algorithms on, cuDNN deterministic and not benchmarking,
    the cuBLAS workspace set, and the RNG seeded from seed, as HF's enable_full_determinism; off,
    none of the switches."""
    run = results["full_determinism"]
    ours, hf, off = run["ours-True"], run["hf-True"], run["ours-False"]
    assert ours == hf, run
    assert ours["deterministic"] and ours["cudnn_deterministic"] and not ours["cudnn_benchmark"], run
    assert ours["cublas_workspace"] == ":16:8", run
    assert not off["deterministic"] and not off["cudnn_deterministic"] and off["cublas_workspace"] is None
    assert off["draw"] == ours["draw"], run  # seeded from seed=5 either way


def test_log_level_and_log_level_replica_set_transformers_verbosity(results):
    """The main process takes log_level (as HF's: info is INFO, passive keeps the current level),
    rank 1 of 2 log_level_replica."""
    run = results["log_level"]
    assert run["ours-info"] == run["hf-info"] == logging.INFO, run
    assert run["ours-error"] == logging.ERROR and run["ours-passive"] == logging.WARNING, run
    assert run["replica-error"] == logging.ERROR and run["replica-passive"] == logging.WARNING, run


def test_do_predict_in_an_hf_shaped_script_writes_hfs_results(results):
    """do_predict is a flag for scripts (neither Trainer reads it): a script in the shape of HF's
    examples parses it with HfArgumentParser and, only with it, writes HF's predict files."""
    run = results["do_predict"]
    assert run["ours-0"]["files"] == run["hf-0"]["files"] == [], run
    assert run["ours-1"]["files"] == run["hf-1"]["files"] == ["all_results.json", "predict_results.json"]
    assert close([run["ours-1"]["predict_loss"]], [run["hf-1"]["predict_loss"]], rel=1e-3), run
