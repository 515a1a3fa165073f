"""HF's Trainer methods beyond the loop on 2 ranks, through the public API under the deepspeed
launcher: one launch of tests/helpers/hf_methods_scenario.py (a 4-step run, evaluated in and after
training, whose log history the model card is written from)."""

from __future__ import annotations

import importlib.metadata
import json
import re

import pytest
import yaml

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics

pytestmark = pytest.mark.distributed

KEYS = ("input_ids", "attention_mask", "labels")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_methods")
    launch(["tests/helpers/hf_methods_scenario.py", str(out)], launcher="torchrun")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks


def test_the_train_loader_yields_the_micro_batches_training_consumed(run):
    _, ranks = run
    for res in ranks:
        loader = res["train_loader"]
        # 40 rows on 2 ranks: 20 per rank, in 10 micro-batches of 2; 4 steps x 2 micro-batches trained.
        assert len(loader["indices"]) == 20 and len(loader["batches"]) == 10
        windows = [loader["batches"][i : i + 2] for i in range(0, 8, 2)]
        assert windows == res["windows"]  # the same rows, padded and labelled alike
        firsts = [row[0] - 1 for b in loader["batches"] for row in b["input_ids"]]
        assert firsts == loader["indices"]  # each batch holds the sampler's rows, in its order
        assert loader["num_examples"] == 40  # all ranks' samples, as HF's
        numels = [len(b["input_ids"]) * len(b["input_ids"][0]) for b in loader["batches"]]
        assert loader["num_tokens"] == sum(numels)
        assert loader["num_tokens_3"] == numels[0] * 3
    first, second = (set(r["train_loader"]["indices"]) for r in ranks)
    assert not first & second and len(first | second) == 40  # the ranks' shards split the data


def padding_masked(loader: dict) -> list[dict]:
    """The loader's batches as evaluate forwards them: a padding row's labels masked."""
    batches = [json.loads(json.dumps(b)) for b in loader["batches"]]
    rows = [row for b in batches for row in b["labels"]]
    for i, row in zip(loader["indices"], rows, strict=True):
        if i == -1:
            row[:] = [-100] * len(row)
    return batches


def test_eval_and_test_loaders_yield_what_evaluate_and_predict_forward(run):
    _, ranks = run
    for rank, res in enumerate(ranks):
        evals, tests = res["eval_loader"], res["test_loader"]
        # 13 rows on 2 ranks: 7 each, in batches of 4 and 3; rank 1's last is a copy of row 0.
        assert evals["indices"] == [*range(rank, 13, 2), *([-1] if rank else [])]
        assert [len(b["input_ids"]) for b in evals["batches"]] == [4, 3]
        if rank == 1:
            padding = evals["batches"][-1]["input_ids"][-1]
            assert padding[: len(res["eval_row0"])] == res["eval_row0"]
        for phase in ("eval@2", "eval@4", "evaluate"):
            assert res["forwards"][phase] == padding_masked(evals), phase
        # 9 rows: 5 each, in batches of 4 and 1.
        assert tests["indices"] == [*range(rank, 9, 2), *([-1] if rank else [])]
        assert res["forwards"]["predict"] == padding_masked(tests)
        assert [len(b["input_ids"]) for b in tests["batches"]] == [4, 1]
        assert (evals["num_examples"], tests["num_examples"]) == (13, 9)


def test_log_adds_epoch_and_step_to_the_history_and_metrics_jsonl(run):
    out, ranks = run
    history = ranks[0]["log_history"]
    during = [r for r in history if "during_training" in r]
    assert during == [{"during_training": 3.0, "epoch": 0.6, "step": 3}]  # 12 of 20 rows per rank
    epoch = ranks[0]["state_epoch"]
    assert history[-3:] == [
        {"after_training": 2.5, "epoch": epoch, "step": 4},
        {"without_writer": 1.0, "epoch": epoch, "step": 4},
        {"writer_back": 1.0, "epoch": epoch, "step": 4},
    ]
    rows = read_metrics(out / "run")
    assert {"during_training": 3.0, "epoch": 0.6, "step": 3} in rows
    # Rows logged after train() are written too: the evaluation, and log() while MetricsCallback is in.
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 4]
    assert rows[-2:] == [{"step": 4, "after_training": 2.5, "epoch": epoch}, {"step": 4, "writer_back": 1.0,
                                                                              "epoch": epoch}]  # fmt: skip
    # As HF's, on_log gets the logs without the step.
    seen = ranks[1]["on_log_seen"]
    assert {"during_training": 3.0, "epoch": 0.6} in seen and not any("step" in logs for logs in seen)


def test_pop_and_remove_callback_on_a_trainer(run):
    _, ranks = run
    for res in ranks:
        assert res["popped_is_instance"] and res["pop_absent"] == "NoneType"
        assert res["callbacks"] == ["DefaultFlowCallback", "Forwards", "LogAtStep", "MetricsCallback"]


def test_the_optimizer_and_scheduler_are_the_engines(run):
    _, ranks = run
    for res in ranks:
        opt = res["optimizer"]
        assert (
            opt["create_optimizer_is_engines"] and opt["create_scheduler_is_engines"] and opt["engine_kept"]
        )
        assert opt["other_model"].startswith("ValueError: Trainer.create_optimizer: DeepSpeed builds")
        assert opt["other_optimizer"].startswith("ValueError: Trainer.create_scheduler: DeepSpeed steps")
        # Built before train(): the 8-step schedule is the one that trains (4 steps of it). A logged
        # rate is the one the step applied (2 warmup steps): 0, 1/2, then (8 - 2) / (8 - 2) and
        # (8 - 3) / (8 - 2) of the peak, where a 4-step schedule has 1/2 at step 4.
        early = res["early"]
        assert early["engine_kept"] and early["total_num_steps"] == 8
        assert early["learning_rates"] == pytest.approx([0.0, 5e-3, 1e-2, 1e-2 * 5 / 6])
        # create_optimizer alone: HF's default 3 planned epochs of 20 rows per rank in micro-batches of 2.
        planned = res["planned"]
        assert planned["is_engines"] and planned["total_num_steps"] == 30
        decay, no_decay = planned["param_groups"]
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert decay["numel"] == sum(planned["numels"][n] for n in planned["decay_names"])
        assert no_decay["numel"] == sum(planned["numels"].values()) - decay["numel"]


def test_refusals_name_what_to_do_instead(run):
    _, ranks = run
    for res in ranks:
        push, search = res["refusals"]["push_to_hub"], res["refusals"]["hyperparameter_search"]
        assert push.startswith("NotImplementedError: Trainer.push_to_hub: nothing is uploaded")
        assert "the push_to_hub field" in push and "upload_folder" in push
        assert search.startswith("NotImplementedError: Trainer.hyperparameter_search: not supported")
        assert "one training per trial" in search


def card_parts(out):
    text = (out / "run" / "README.md").read_text()
    _, header, body = text.split("---\n", 2)
    return yaml.safe_load(header), body


def test_the_model_card_is_written_on_the_main_process_only(run):
    out, ranks = run
    assert [r["card_after_rank1"] for r in ranks] == [False, False]
    meta, body = card_parts(out)
    assert "from-rank-1" not in body and meta["model-index"][0]["name"] == "run"


def test_the_model_card_says_what_the_run_was(run):
    out, ranks = run
    meta, body = card_parts(out)
    evals = ranks[0]["eval_metrics"]
    assert meta["library_name"] == "transformers" and meta["base_model"] == "org/tiny-base"
    assert (meta["language"], meta["license"]) == (["en"], "apache-2.0")
    assert meta["tags"] == ["tiny", "kept-tag", "generated_from_trainer"]  # a card's tags are kept
    assert meta["datasets"] == ["toy-corpus"]
    (result,) = meta["model-index"][0]["results"]
    assert result["task"] == {"type": "text-generation", "name": "Causal Language Modeling"}
    assert result["dataset"] == {"name": "toy corpus", "type": "toy-corpus"}
    assert meta["metrics"] == ["accuracy"]  # the hub's metric tags among the eval results, as HF's
    assert result["metrics"] == [{"name": "Accuracy", "type": "accuracy", "value": evals["eval_accuracy"]}]
    assert "This model is a fine-tuned version of [org/tiny-base](https://huggingface.co/org/tiny-base) " \
           "on the toy corpus dataset." in body  # fmt: skip
    assert f"- Loss: {evals['eval_loss']:.4f}\n" in body
    hp = dict(re.findall(r"^- (\w+): (.*)$", body.split("### Training hyperparameters")[1], re.M))
    assert {k: hp[k] for k in (
        "learning_rate", "train_batch_size", "eval_batch_size", "seed", "distributed_type", "num_devices",
        "gradient_accumulation_steps", "total_train_batch_size", "total_eval_batch_size", "lr_scheduler_type",
        "training_steps",
    )} == {
        "learning_rate": "0.001", "train_batch_size": "2", "eval_batch_size": "4", "seed": "0",
        "distributed_type": "DeepSpeed ZeRO-1", "num_devices": "2", "gradient_accumulation_steps": "2",
        "total_train_batch_size": "8", "total_eval_batch_size": "8", "lr_scheduler_type": "constant",
        "training_steps": "4",
    }  # fmt: skip
    assert hp["optimizer"].startswith("Use adamw_torch (DeepSpeed Adam: lr=0.001, betas=[0.9, 0.999]")
    versions = dict(re.findall(r"^- (\S+) (\S+)$", body.split("### Framework versions")[1], re.M))
    for name, dist in (("ds-llm-trainer", "ds-llm-trainer"), ("Transformers", "transformers"),
                       ("PyTorch", "torch"), ("DeepSpeed", "deepspeed"), ("Datasets", "datasets")):  # fmt: skip
        assert versions[name] == importlib.metadata.version(dist)


def test_the_model_cards_results_table_is_the_log_history(run):
    out, ranks = run
    _, body = card_parts(out)
    table = body.split("### Training results\n\n")[1].split("\n\n")[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["Training Loss", "Epoch", "Step", "Validation Loss", "Accuracy"]
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    history = ranks[0]["log_history"]
    losses = {r["step"]: r["loss"] for r in history if "loss" in r}
    evals = {r["step"]: r for r in history if "eval_loss" in r}  # the last evaluation of a step
    assert [int(line[2]) for line in lines] == [1, 2, 3, 4]
    for loss, epoch, step, val, acc in lines:  # numbers shown to 4 decimals
        assert float(loss) == pytest.approx(losses[int(step)], abs=5e-5)
        assert float(epoch) == pytest.approx(int(step) * 0.2)
        row = evals.get(int(step))
        if row is None:
            assert (val, acc) == ("-", "-")
        else:
            assert float(val) == pytest.approx(row["eval_loss"], abs=5e-5)
            assert float(acc) == pytest.approx(row["eval_accuracy"], abs=5e-5)
