"""HF's result API (TrainOutput, log/save_metrics, save_state, main_process_first, predict with
preprocess_logits_for_metrics, HF's evaluation arguments) on 2 ranks, through the public API under
torchrun: one launch of tests/helpers/hf_api_scenario.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics

pytestmark = pytest.mark.distributed

TRAIN_KEYS = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "train_loss",
    "epoch",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_api")
    proc = launch(["tests/helpers/hf_api_scenario.py", str(out)], launcher="torchrun")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks, proc.stdout


def test_train_returns_hfs_train_output_matching_metrics_jsonl(run):
    out, ranks, _ = run
    for res in ranks:
        assert res["is_train_output"]
        step, loss, metrics = res["train_output"]
        assert step == res["state_global_step"] == 4
        assert set(metrics) == TRAIN_KEYS
        assert loss == metrics["train_loss"]
    _, loss, metrics = ranks[0]["train_output"]
    assert ranks[1]["train_output"][2]["train_loss"] == loss  # every rank reports the run's loss
    logged = read_metrics(out / "run")
    losses = [r["loss"] for r in logged if "loss" in r]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]
    # Every step has 4 rows x 23 target tokens: the token-weighted mean is the mean of the steps.
    assert loss == pytest.approx(sum(losses) / 4, rel=1e-9)
    # The summary is logged as HF logs it: one row with the step. The finished run resumed later logs
    # its own (it trained nothing): metrics.jsonl holds every row of the log history.
    summary = [r for r in logged if "train_runtime" in r]
    assert summary == [{**metrics, "step": 4}, {**ranks[0]["resumed"]["output"][2], "step": 4}]
    assert metrics["epoch"] == ranks[0]["state_epoch"] == 0.5  # 16 of 32 rows
    runtime = metrics["train_runtime"]
    assert runtime > 0
    assert metrics["train_samples_per_second"] * runtime == pytest.approx(16, rel=0.01)  # 4 x 2 x 2 ranks
    assert metrics["train_steps_per_second"] * runtime == pytest.approx(4, rel=0.01)
    assert metrics["total_flos"] == pytest.approx(ranks[0]["flops_per_token"] * 16 * 24, rel=1e-12)


def test_a_finished_run_resumed_returns_a_train_output(run):
    _, ranks, _ = run
    first = ranks[0]["train_output"][2]
    for res in ranks:
        assert res["resumed"]["is_train_output"]
        step, loss, metrics = res["resumed"]["output"]
        assert (step, loss) == (4, 0.0)
        assert set(metrics) == TRAIN_KEYS
        assert metrics["train_samples_per_second"] == metrics["train_steps_per_second"] == 0.0
        assert metrics["total_flos"] == first["total_flos"]  # the run's FLOPs, from the checkpoint


def test_saved_results_and_state(run):
    out, ranks, _ = run
    run_dir = out / "run"
    train = ranks[0]["train_output"][2]
    evals = ranks[0]["eval_metrics"]
    assert json.loads((run_dir / "train_results.json").read_text()) == train
    assert json.loads((run_dir / "eval_results.json").read_text()) == evals
    assert json.loads((run_dir / "all_results.json").read_text()) == {**train, **evals}
    assert json.loads((run_dir / "probe_results.json").read_text()) == {"rank": 0}  # main process only
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert state["is_world_process_zero"] is True  # rank 1's state says false: rank 0 wrote it
    assert state["num_input_tokens_seen"] == 16 * 24
    assert state["log_history"] == ranks[0]["log_history"][: len(state["log_history"])]
    assert state["log_history"][-1] == {**evals, "step": 4}


def test_log_metrics_prints_hfs_block_on_the_main_process_only(run, capsys):
    from transformers.trainer_pt_utils import log_metrics

    _, ranks, stdout = run
    assert stdout.count("***** train metrics *****") == 1
    assert stdout.count("***** eval metrics *****") == 1
    hf_main = SimpleNamespace(is_world_process_zero=lambda: True)
    for split, metrics in (("train", ranks[0]["train_output"][2]), ("eval", ranks[0]["eval_metrics"])):
        log_metrics(hf_main, split, metrics)  # what HF's Trainer prints for the same metrics
        assert capsys.readouterr().out in stdout


def test_main_process_first_runs_the_main_process_before_the_others(run):
    out, ranks, _ = run
    assert (out / "order.txt").read_text().splitlines() == ["enter 0", "exit 0", "enter 1", "exit 1"]
    assert [r["args"]["process_index"] for r in ranks] == [0, 1]
    assert [r["args"]["local_process_index"] for r in ranks] == [0, 1]
    assert {r["args"]["world_size"] for r in ranks} == {2}
    assert [r["args"]["should_save"] for r in ranks] == [True, False]
    assert [r["args"]["should_log"] for r in ranks] == [True, False]
    assert [r["is_world_process_zero"] for r in ranks] == [True, False]
    assert [r["is_local_process_zero"] for r in ranks] == [True, False]
    assert {(r["args"]["device"], r["args"]["n_gpu"], r["args"]["parallel_mode"]) for r in ranks} == {
        ("cpu", 0, "distributed")
    }


def test_predict_gathers_what_preprocess_logits_for_metrics_returns(run):
    _, ranks, _ = run
    ref = ranks[0]["reference"]
    n, width = len(ref["rows"]), max(len(r) for r in ref["rows"])
    for res in ranks:
        assert res["is_prediction_output"]
        assert res["predictions_dtype"] == "int64"
        preds, labels = np.array(res["predictions"]), np.array(res["label_ids"])
        assert preds.shape == labels.shape == (n, width)
        for i, row in enumerate(ref["rows"]):
            assert labels[i, : len(row)].tolist() == row
            assert preds[i, : len(row)].tolist() == ref["predictions"][i], i
        assert (labels[:, -1] == -100).sum() == n - 1  # shorter rows padded with -100
        # Each rank: 7 rows (one a masked pad) in batches of 4 and 3; full logits stay on the rank.
        calls = res["preprocess_seen"]
        assert [c["logits"][0] for c in calls] == [4, 3] * 2  # evaluate, then predict
        assert all(c["logits"][2] == 256 and c["logits"][:2] == c["labels"] for c in calls)
        assert res["preprocess_calls_in_evaluate"] == 2
        # What went into the gathers: each batch's [rows, seq] int64 ids, never [seq, vocab] logits.
        sent = [s for gather in res["gathered"] for s in gather]
        assert sent and all(s.endswith(":int64") and s.count(",") == 1 for s in sent)
        assert res["metric_inputs"] == ["transformers.trainer_utils.EvalPrediction"] * 2


def test_predict_and_evaluate_metrics(run):
    _, ranks, _ = run
    ref_loss = ranks[0]["reference"]["loss"]
    for res in ranks:
        test, evals = res["predict_metrics"], res["eval_metrics"]
        assert set(test) == {
            "test_loss",
            "test_accuracy",
            "test_runtime",
            "test_samples_per_second",
            "test_steps_per_second",
        }
        assert test["test_loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert set(evals) == {k.replace("test_", "eval_") for k in test} | {"epoch"}
        assert evals["eval_loss"] == pytest.approx(test["test_loss"], rel=1e-9)
        assert evals["eval_accuracy"] == test["test_accuracy"]
        assert isinstance(test["test_accuracy"], float) and 0 <= test["test_accuracy"] <= 1
        assert evals["epoch"] == 0.5


def test_a_compute_loss_override_trains_what_the_builtin_loss_trains(run):
    _, ranks, _ = run
    rows = ranks[0]["reference"]["rows"]
    for res in ranks:
        runs = res["compute_loss"]
        base = runs["builtin"]
        assert len(base["losses"]) == 2 and base["losses"][0] != base["losses"][1]
        sums, targets = base["row_sums"], [len(r) - 1 for r in rows]
        # Evaluated, the built-in causal loss is token-weighted; an override's is HF's: the mean of
        # the batch means, each weighted by its rows.
        assert base["eval_loss"] == pytest.approx(sum(sums) / sum(targets), rel=1e-5)
        batches = [[i for i in b if i >= 0] for b in batches_of_two_ranks(len(rows), 8)]  # HF's default size
        means = [sum(sums[i] for i in b) / sum(targets[i] for i in b) for b in batches]
        hf_mean = sum(m * len(b) for m, b in zip(means, batches, strict=True)) / len(rows)
        for name in ("hand", "super"):
            assert runs[name]["losses"] == pytest.approx(base["losses"], rel=1e-6)
            assert runs[name]["eval_loss"] == pytest.approx(hf_mean, rel=1e-5)
            assert runs[name]["weights"] == pytest.approx(base["weights"], rel=1e-5, abs=1e-7)
    # num_items_in_batch is the window's target tokens on both ranks, for each of its micro-batches;
    # in evaluation, the batch's own.
    items = [res["compute_loss"]["hand_items"] for res in ranks]
    for w in (0, 1):
        calls = [c for rank_items in items for c in rank_items[2 * w : 2 * w + 2]]
        assert {n for n, _ in calls} == {sum(own for _, own in calls)}
    for rank_items in items:
        assert [n for n, own in rank_items[4:]] == [own for n, own in rank_items[4:]] != []


def batches_of_two_ranks(n: int, batch_size: int) -> list[list[int]]:
    """The evaluation batches of 2 ranks: rank r takes rows r, r + 2, ...; -1 pads rank 1's shard."""
    shards = [list(range(r, n, 2)) for r in (0, 1)]
    shards[1] += [-1] * (len(shards[0]) - len(shards[1]))
    return [s[i : i + batch_size] for s in shards for i in range(0, len(s), batch_size)]


def test_include_for_metrics_gives_inputs_and_each_rows_batch_loss(run):
    _, ranks, _ = run
    ref = ranks[0]["reference"]
    rows, sums = ref["rows"], ref["sums"]
    expected = [0.0] * len(rows)  # each row's batch mean: its batch's token losses over its targets
    for batch in batches_of_two_ranks(len(rows), 4):
        real = [i for i in batch if i >= 0]
        mean = sum(sums[i] for i in real) / sum(len(rows[i]) - 1 for i in real)
        for i in real:
            expected[i] = mean
    for res in ranks:
        included = res["options"]["include"]
        assert included["same"]  # eval_accumulation_steps=1: the same predictions
        (call,) = included["calls"]
        width = max(map(len, rows))
        for i, row in enumerate(rows):
            assert call["inputs"][i][: len(row)] == row
            assert set(call["inputs"][i][len(row) :]) <= {0, -100} and len(call["inputs"][i]) == width
        assert call["losses"] == pytest.approx(expected, rel=1e-5)


def test_batch_eval_metrics_get_each_steps_rows_of_both_ranks(run):
    _, ranks, _ = run
    rows = ranks[0]["reference"]["rows"]
    for res in ranks:
        batched = res["options"]["batch"]
        evaluate = batched["calls"][:2]
        # Two steps: 4 rows per rank, then 3 (rank 1's last a padding row): 8 rows, then 5.
        assert [c["compute_result"] for c in evaluate] == [False, True]
        assert all(c["tensors"] for c in evaluate)  # torch tensors, as HF's batch metrics get
        labels = [label for c in evaluate for label in c["labels"]]
        assert [len(c["labels"]) for c in evaluate] == [8, 5]
        assert [label[: len(row)] for label, row in zip(labels, rows, strict=True)] == rows
        assert batched["eval_calls"] == 2  # evaluate returns the last call's result
        assert batched["predict_kept"]  # predict keeps its predictions


def test_prediction_loss_only_and_a_set_without_labels(run):
    _, ranks, _ = run
    for res in ranks:
        loss_only = res["options"]["loss_only"]
        assert loss_only["none"]
        assert loss_only["metrics"]["test_loss"] == pytest.approx(ranks[0]["reference"]["loss"], rel=1e-5)
        unlabelled = res["options"]["no_labels"]
        assert unlabelled["labels"] is None and "test_loss" not in unlabelled["metrics"]
        assert unlabelled["same"]  # the same predictions as with labels
