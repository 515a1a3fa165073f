"""Callback decisions and TrainerState persistence (no engine needed)."""

from __future__ import annotations

from trainer.args import TrainingArguments
from trainer.loop.callbacks import DefaultFlowCallback, EarlyStoppingCallback, TrainerControl, TrainerState


def _flow(args: TrainingArguments, step: int, max_steps: int = 100) -> TrainerControl:
    state = TrainerState(global_step=step, max_steps=max_steps)
    return DefaultFlowCallback().on_step_end(args, state, TrainerControl())


def test_flow_follows_step_strategies():
    args = TrainingArguments(logging_steps=10, eval_strategy="steps", eval_steps=25, save_steps=50)
    c = _flow(args, 50)
    assert (c.should_log, c.should_evaluate, c.should_save, c.should_training_stop) == (
        True,
        True,
        True,
        False,
    )
    c = _flow(args, 25)
    assert (c.should_log, c.should_evaluate, c.should_save) == (False, True, False)
    c = _flow(args, 100)
    assert c.should_training_stop and c.should_save and c.should_log


def test_flow_epoch_strategies_and_no_save():
    args = TrainingArguments(eval_strategy="epoch", save_strategy="epoch")
    c = DefaultFlowCallback().on_epoch_end(args, TrainerState(), TrainerControl())
    assert c.should_evaluate and c.should_save
    assert not _flow(TrainingArguments(save_strategy="no"), 100).should_save


def test_early_stopping_counts_evaluations_without_improvement():
    args = TrainingArguments()
    cb = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.01)
    control = TrainerControl()
    for loss in (3.0, 2.5, 2.495, 2.6):
        control = cb.on_evaluate(args, TrainerState(), control, metrics={"eval_loss": loss})
    assert control.should_training_stop and cb.best == 2.5


def test_early_stopping_respects_greater_is_better():
    args = TrainingArguments(metric_for_best_model="accuracy")
    cb = EarlyStoppingCallback(early_stopping_patience=1)
    control = cb.on_evaluate(args, TrainerState(), TrainerControl(), metrics={"eval_accuracy": 0.5})
    control = cb.on_evaluate(args, TrainerState(), control, metrics={"eval_accuracy": 0.7})
    assert not control.should_training_stop and cb.best == 0.7


def test_state_round_trips_through_json(tmp_path):
    state = TrainerState(
        global_step=7, epoch_index=1, samples_into_epoch=12, log_history=[{"step": 7, "loss": 1.5}]
    )
    state.save_to_json(tmp_path / "s.json")
    assert TrainerState.load_from_json(tmp_path / "s.json") == state
