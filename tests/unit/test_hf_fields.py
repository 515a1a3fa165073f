"""Every field of the installed transformers' ``TrainingArguments`` is ours (with HF's meaning) or
refused with a reason: a new transformers release cannot add a field that is silently ignored."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from trainer.args import TrainingArguments
from trainer.callbacks import DefaultFlowCallback, TrainerControl, TrainerState
from trainer.hf_fields import ONLY, REFUSED

HF_FIELDS = [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]


def test_every_hf_field_is_honoured_or_refused():
    ours = set(TrainingArguments.model_fields)
    unaccounted = [
        name for name in HF_FIELDS if name not in ours and name not in REFUSED and name not in ONLY
    ]
    assert unaccounted == []
    assert not (set(REFUSED) | set(ONLY)) & ours  # a refused field is not also a field of ours


def test_the_refusal_table_names_only_hf_fields():
    assert sorted((set(REFUSED) | set(ONLY)) - set(HF_FIELDS)) == []


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_says_why_whatever_its_value(name):
    with pytest.raises(ValueError) as err:
        TrainingArguments(**{name: True})
    assert f"{name}: HF's field, refused: {REFUSED[name]}" in str(err.value)


@pytest.mark.parametrize(
    ("name", "other"), [("label_names", ["label"]), ("average_tokens_across_devices", False)]
)
def test_a_field_fixed_to_our_behaviour_is_accepted_there_and_refused_elsewhere(name, other):
    for value in ONLY[name][0]:
        assert TrainingArguments(**{name: value}).to_dict() == TrainingArguments().to_dict()
    with pytest.raises(ValueError, match=f"{name}: only .* is supported: {ONLY[name][1][:30]}"):
        TrainingArguments(**{name: other})


def test_a_misspelled_field_still_gets_did_you_mean():
    with pytest.raises(ValueError, match="learning_rat: unknown key; did you mean learning_rate"):
        TrainingArguments(learning_rat=1e-3)


def flow(args: TrainingArguments, steps: int, per_epoch: int) -> list[int]:
    """The steps DefaultFlowCallback logs at, walking ``steps`` steps of ``per_epoch`` each."""
    callback, state, logged = DefaultFlowCallback(), TrainerState(max_steps=steps), []
    for step in range(1, steps + 1):
        control = TrainerControl()
        state.global_step = step
        callback.on_step_end(args, state, control)
        if step % per_epoch == 0 and step < steps:
            callback.on_epoch_end(args, state, control)
        if control.should_log:
            logged.append(step)
    return logged


def test_logging_strategy_and_logging_first_step_as_hf_defines_them():
    assert flow(TrainingArguments(logging_steps=4), 10, 5) == [4, 8, 10]
    assert flow(TrainingArguments(logging_steps=4, logging_first_step=True), 10, 5) == [1, 4, 8, 10]
    assert flow(TrainingArguments(logging_strategy="epoch"), 12, 5) == [5, 10, 12]
    assert flow(TrainingArguments(logging_strategy="no"), 10, 5) == [10]  # the last step always logs
