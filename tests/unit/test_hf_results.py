"""HF's result API without a launcher: the train metrics, the result files and the printed block
(against transformers' own helpers), TrainingArguments' process helpers, and the evaluation loop
over a real tiny model (HF's EvalPrediction, preprocess_logits_for_metrics, -100 padding)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers import TrainerState as HFTrainerState
from transformers.trainer_pt_utils import log_metrics as hf_log_metrics
from transformers.trainer_pt_utils import save_metrics as hf_save_metrics
from transformers.trainer_utils import EvalPrediction, PredictionOutput, TrainOutput
from transformers.training_args import ParallelMode

from trainer import Trainer, TrainingArguments
from trainer.data import CausalLMCollator
from trainer.engine import CausalLM, ModelLoss, causal_lm_loss_sum
from trainer.loop import trainer as trainer_module
from trainer.loop.callbacks import TrainerState
from trainer.loop.evaluation import Predictions, eval_batches, evaluation_loop
from trainer.observe.results import TrainTotals, format_metrics, save_metrics, save_state, train_metrics
from trainer.runtime.mesh import Mesh

# ---- train metrics -------------------------------------------------------------------------------


def test_train_loss_is_token_weighted_and_skips_non_finite_windows():
    totals = TrainTotals()
    totals.add_window(30.0, 10.0)  # mean 3.0 over 10 tokens
    totals.add_window(10.0, 30.0)  # mean 0.33 over 30 tokens
    totals.add_window(float("nan"), 5.0)
    assert totals.mean_loss == pytest.approx(40.0 / 40.0)
    assert TrainTotals().mean_loss == 0.0  # no step trained: HF reports 0.0 too


def test_train_metrics_have_hfs_keys_and_rates():
    totals = TrainTotals(start_time=time.time() - 10.0, steps=5, samples=80.0)
    totals.add_window(60.0, 20.0)
    metrics = train_metrics(totals, total_flos=1.5e12, epoch=0.25)
    assert list(metrics) == [
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "epoch",
    ]
    assert metrics["train_runtime"] == pytest.approx(10.0, abs=0.5)
    assert metrics["train_samples_per_second"] == pytest.approx(80.0 / metrics["train_runtime"], rel=1e-3)
    assert metrics["train_steps_per_second"] == pytest.approx(5.0 / metrics["train_runtime"], rel=1e-3)
    assert (metrics["total_flos"], metrics["train_loss"], metrics["epoch"]) == (1.5e12, 3.0, 0.25)


def test_train_output_and_prediction_output_are_hfs():
    assert trainer_module.TrainOutput is TrainOutput
    assert trainer_module.PredictionOutput is PredictionOutput
    assert trainer_module.EvalPrediction is EvalPrediction


# ---- result files and the printed block ----------------------------------------------------------

METRICS = {"train_runtime": 3723.456, "total_flos": 3.5 * 2**30, "train_loss": 1.23456789, "epoch": 2.0}


def test_format_metrics_prints_what_hf_prints(capsys):
    hf_log_metrics(SimpleNamespace(is_world_process_zero=lambda: True), "train", METRICS)
    assert capsys.readouterr().out == format_metrics("train", METRICS) + "\n"
    assert "  train_runtime = 1:02:03.45" in format_metrics("train", METRICS)


def test_save_metrics_writes_what_hf_writes(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    theirs.mkdir()
    hf = SimpleNamespace(is_world_process_zero=lambda: True, args=SimpleNamespace(output_dir=str(theirs)))
    evals = {"eval_loss": 2.5, "epoch": 3.0}
    for split, metrics in (("train", METRICS), ("eval", evals)):
        save_metrics(ours, split, metrics)
        hf_save_metrics(hf, split, metrics)
    save_metrics(ours, "test", {"test_loss": 1.0}, combined=False)
    hf_save_metrics(hf, "test", {"test_loss": 1.0}, combined=False)
    names = ["train_results.json", "eval_results.json", "test_results.json", "all_results.json"]
    assert sorted(p.name for p in ours.iterdir()) == sorted(names)
    for name in names:
        assert (ours / name).read_text() == (theirs / name).read_text(), name
    assert json.loads((ours / "all_results.json").read_text()) == {**METRICS, **evals}


def test_save_state_writes_trainer_state_json(tmp_path):
    state = TrainerState(global_step=7, log_history=[{"step": 7, "loss": 1.5}])
    path = save_state(tmp_path / "out", state)
    assert path == tmp_path / "out" / "trainer_state.json"
    hf = HFTrainerState.load_from_json(str(path))  # HF's shape, which HF reads back
    assert (hf.global_step, hf.log_history, hf.stateful_callbacks) == (7, [{"step": 7, "loss": 1.5}], {})
    assert set(json.loads(path.read_text())) == {f.name for f in dataclasses.fields(HFTrainerState)}


def test_only_the_main_process_writes_or_prints(tmp_path, capsys):
    """The Trainer's methods, on a stand-in for a non-main rank: nothing printed, nothing written."""
    for main in (False, True):
        out = tmp_path / str(main)
        rank = SimpleNamespace(
            is_world_process_zero=lambda main=main: main,
            args=SimpleNamespace(output_dir=str(out)),
            state=TrainerState(global_step=3),
        )
        Trainer.log_metrics(rank, "train", METRICS)
        Trainer.save_metrics(rank, "train", METRICS)
        Trainer.save_state(rank)
        printed = capsys.readouterr().out
        files = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if main:
            assert printed.startswith("***** train metrics *****")
            assert files == ["all_results.json", "train_results.json", "trainer_state.json"]
        else:
            assert (printed, files) == ("", [])


# ---- TrainingArguments' process helpers ----------------------------------------------------------


@pytest.fixture
def replica(monkeypatch):
    """This process as rank 3 of 4, the second on its node (no process group is started)."""
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)


def test_rank_facts_come_from_the_launchers_environment(replica):
    args = TrainingArguments()
    assert (args.process_index, args.local_process_index, args.world_size) == (3, 1, 4)
    assert (args.should_log, args.should_save) == (False, False)
    assert args.get_process_log_level() == logging.WARNING
    assert args.parallel_mode == ParallelMode.DISTRIBUTED


def test_a_single_process_is_the_main_one(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = TrainingArguments()
    assert (args.process_index, args.local_process_index, args.world_size) == (0, 0, 1)
    assert (args.should_log, args.should_save) == (True, True)
    assert args.parallel_mode == ParallelMode.NOT_PARALLEL
    assert args.device == torch.device("cpu") and args.n_gpu == 0
    from transformers.utils import logging as hf_logging

    assert args.get_process_log_level() == hf_logging.get_verbosity()
    ran, before = [], dist.is_initialized()  # (an earlier test of this process may have started one)
    with args.main_process_first(desc="tokenize"):
        ran.append(True)
    assert ran == [True] and dist.is_initialized() == before  # a world of one needs no process group


def test_serialisation_helpers():
    args = TrainingArguments(output_dir="o", report_to="tensorboard", per_device_train_batch_size=3)
    d = args.to_dict()
    assert (
        d["output_dir"] == "o" and d["report_to"] == ["tensorboard"] and d["resume_from_checkpoint"] is None
    )
    assert json.loads(args.to_json_string()) == d
    assert args.to_json_string().startswith('{\n  "output_dir": "o"')
    s = args.to_sanitized_dict()
    assert s["train_batch_size"] == 3 and s["eval_batch_size"] == 8
    assert s["report_to"] == "['tensorboard']" and s["resume_from_checkpoint"] == "None"
    assert {type(v) for v in s.values()} <= {bool, int, float, str}


# ---- the evaluation loop -------------------------------------------------------------------------


class TinyEngine:
    """The engine members the evaluation loop uses, over a real tiny Llama in this process."""

    device = torch.device("cpu")
    objective = CausalLM()
    mesh = Mesh(world_size=1)  # no tensor-parallel group: its rows count

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, use_cache=False,
        )  # fmt: skip
        self.module = LlamaForCausalLM(config)
        self.modes: list[bool] = []

    def train(self, mode: bool = True) -> None:
        self.modes.append(mode)
        self.module.train(mode)

    @torch.no_grad()
    def eval_step(self, batch, outputs=False):
        out = self.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"]
        count = (labels[:, 1:] != -100).sum().float()
        return causal_lm_loss_sum(out.logits, labels), count, out if outputs else None


ROWS = [[(7 * i + k) % 63 + 1 for k in range(3 + 2 * i)] for i in range(7)]  # lengths 3..15


def test_eval_batches_shard_and_pad_with_masked_rows():
    data = [{"input_ids": r} for r in ROWS]
    shards = [list(eval_batches(data, CausalLMCollator(0), 2, rank, 2)) for rank in (0, 1)]
    assert [idx for _, idx in shards[0]] == [[0, 2], [4, 6]]
    assert [idx for _, idx in shards[1]] == [[1, 3], [5, -1]]
    last, rows = CausalLM().eval_rows(*shards[1][-1])
    assert rows == [5, -1] and (last["labels"][1] == -100).all()
    assert (last["labels"][0, : len(ROWS[5])] != -100).all()


def test_padding_rows_are_cut_from_a_models_own_loss_and_a_batch_of_padding_counts_nothing():
    batch = {"input_ids": torch.arange(6).view(3, 2), "labels": torch.tensor([0.5, 1.5, 2.5])}
    own = ModelLoss(per_item=False)
    cut, rows = own.eval_rows(batch, [4, 7, -1])
    assert rows == [4, 7] and cut["labels"].tolist() == [0.5, 1.5] and cut["input_ids"].shape == (2, 2)
    alone, rows = own.eval_rows(batch, [-1, -1, -1])
    assert rows == [-1] and alone["labels"].tolist() == [0.5]


def test_evaluation_loop_applies_preprocess_before_gathering_and_pads_with_minus_100():
    engine, data, seen = TinyEngine(), [{"input_ids": r} for r in ROWS], []

    def argmax(logits, labels):
        seen.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    def metrics(p):
        assert isinstance(p, EvalPrediction)
        return {"rows": np.int64(len(p.predictions)), "eval_given": 1.0}

    out = evaluation_loop(
        engine,
        eval_batches(data, CausalLMCollator(0), 3, 0, 1),
        len(data),
        "test",
        Predictions(argmax, metrics),
    )
    assert seen == [((3, 7, 64), (3, 7)), ((3, 13, 64), (3, 13)), ((1, 15, 64), (1, 15))]
    assert out.predictions.dtype == np.int64 and out.predictions.shape == out.label_ids.shape == (7, 15)
    for i, row in enumerate(ROWS):
        alone = engine.module(input_ids=torch.tensor([row])).logits[0].argmax(-1)
        assert out.predictions[i, : len(row)].tolist() == alone.tolist()
        assert out.label_ids[i, : len(row)].tolist() == row
    assert (out.predictions[0, 7:] == -100).all() and (out.label_ids[0, 7:] == -100).all()
    # The loss: every target token of the set counted once.
    total = sum(
        causal_lm_loss_sum(engine.module(input_ids=torch.tensor([r])).logits, torch.tensor([r])) for r in ROWS
    )
    targets = sum(len(r) - 1 for r in ROWS)
    assert out.metrics["test_loss"] == pytest.approx(total.item() / targets, rel=1e-5)
    assert out.metrics["test_rows"] == 7 and type(out.metrics["test_rows"]) is int  # denumpified
    assert out.metrics["test_eval_given"] == 1.0  # prefixed unless it already carries the prefix
    assert engine.modes == [False, True]  # back in training mode afterwards


def test_evaluation_loop_without_predictions_gives_the_same_loss():
    engine, data = TinyEngine(), [{"input_ids": r} for r in ROWS]
    plain = evaluation_loop(engine, eval_batches(data, CausalLMCollator(0), 4, 0, 1), len(data))
    logits = evaluation_loop(
        engine, eval_batches(data, CausalLMCollator(0), 4, 0, 1), len(data), "eval", Predictions()
    )
    assert plain.predictions is None and plain.label_ids is None
    assert plain.metrics["eval_loss"] == pytest.approx(logits.metrics["eval_loss"], rel=1e-6)
    assert set(plain.metrics) == {"eval_loss"}  # HF's keys: no perplexity
    assert logits.predictions.dtype == np.float32 and logits.predictions.shape == (7, 15, 64)
    # Row 0 (3 tokens) came in a batch 9 wide: logits up to 9, then HF's -100 padding.
    assert (logits.predictions[0, :9] != -100).all() and (logits.predictions[0, 9:] == -100).all()


def test_tuple_outputs_of_preprocess_are_gathered_element_by_element():
    engine, data = TinyEngine(), [{"input_ids": r} for r in ROWS]
    out = evaluation_loop(
        engine,
        eval_batches(data, CausalLMCollator(0), 4, 0, 1),
        len(data),
        "eval",
        Predictions(lambda logits, labels: (logits.argmax(-1), logits.max(-1).values.mean(-1))),
    )
    ids, means = out.predictions
    assert ids.shape == (7, 15) and means.shape == (7,)


def test_a_compute_loss_override_is_refused_under_the_pipeline_before_the_engine_is_built():
    from trainer.config.errors import ConfigError
    from trainer.engine import build_engine

    override = ModelLoss(per_item=True, compute_loss=lambda *a, **k: 0)
    with pytest.raises(ConfigError, match="^compute_loss: pipeline_parallel_size > 1"):
        build_engine(
            torch.nn.Linear(2, 2), {"pipeline": {"stages": 2}}, Mesh(2, pipeline=2), objective=override
        )
