"""Every field of the installed transformers' ``TrainingArguments`` (and ``Seq2SeqTrainingArguments``)
is an attribute of ours at HF's default: honoured, or refused only when set away from that default,
with the reason. A transformers release that adds a field or changes a default fails here."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers
import yaml
from pydantic import TypeAdapter, ValidationError
from transformers import GenerationConfig, HfArgumentParser

from trainer import Seq2SeqTrainingArguments, TrainingArguments, checkpoint
from trainer.args import RunConfig, hf_fields
from trainer.args.hf_fields import ONLY, OWN_DEFAULTS, REFUSED, SAME_AS_DEFAULT, hf_fields_doc
from trainer.config.errors import ConfigError
from trainer.loop.callbacks import DefaultFlowCallback, TrainerControl, TrainerState

ROOT = Path(__file__).resolve().parents[2]
REFUSED_OR_ONLY = sorted(set(REFUSED) | set(ONLY))
PAIRS = [
    (TrainingArguments, transformers.TrainingArguments),
    (Seq2SeqTrainingArguments, transformers.Seq2SeqTrainingArguments),
]


def hf_defaults(hf_class: type) -> dict[str, tuple[Any, Any]]:
    """Each init field of an HF arguments class: (its declared default, the value a script reads
    from a default instance; HF's __post_init__ fills some, e.g. report_to "none" -> [])."""
    instance = hf_class()
    declared = {}
    for f in dataclasses.fields(hf_class):
        if f.init:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            declared[f.name] = (default, getattr(instance, f.name))
    return declared


@pytest.mark.parametrize(("ours", "hf_class"), PAIRS, ids=lambda c: c.__name__)
def test_every_hf_field_is_ours_at_hfs_default(ours, hf_class):
    hf = hf_defaults(hf_class)
    assert sorted(set(hf) - set(ours.model_fields)) == []  # a field HF added is missing here
    differing = {
        name
        for name, (declared, read) in hf.items()
        if ours.model_fields[name].get_default(call_default_factory=True) not in (declared, read)
    }
    assert differing == set(OWN_DEFAULTS)  # only the defaults docs/training.md names differ
    for name, (theirs, _) in OWN_DEFAULTS.items():
        assert theirs in hf[name], name  # what the docs say HF's default is


def test_the_refusal_tables_name_only_hf_fields():
    hf = set(hf_defaults(transformers.TrainingArguments))
    assert sorted((set(REFUSED) | set(ONLY) | set(SAME_AS_DEFAULT) | set(OWN_DEFAULTS)) - hf) == []


def test_a_script_reads_hfs_defaults():
    """run_clm.py's ending, with arguments parsed as it parses them."""
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", "out"])
    hf = transformers.TrainingArguments(output_dir="out")
    for name in (
        "push_to_hub",
        "hub_model_id",
        "torch_compile",
        "use_liger_kernel",
        "label_smoothing_factor",
    ):
        assert getattr(args, name) == getattr(hf, name), name
    assert (args.push_to_hub, args.hub_model_id, args.hub_strategy) == (False, None, "every_save")


def other_value(name: str) -> Any:
    """A valid value of the field that is not accepted: the first candidate its type takes."""
    field = TrainingArguments.model_fields[name]
    accepted = (field.default, *SAME_AS_DEFAULT.get(name, ()), *ONLY.get(name, ((),))[0])
    for candidate in (not field.default, 2, 0.5, "other", ["other"], {"other": 1}):
        try:
            value = TypeAdapter(field.annotation).validate_python(candidate)
        except ValidationError:
            continue
        if value not in accepted:
            return value
    raise AssertionError(f"{name}: no value to set")


@pytest.mark.parametrize("name", REFUSED_OR_ONLY)
def test_a_refused_field_set_away_from_its_default_is_refused_naming_it(name):
    value = other_value(name)
    why = f"HF's field, refused: {REFUSED[name]}" if name in REFUSED else f"is supported: {ONLY[name][1]}"
    with pytest.raises(ConfigError) as err:
        TrainingArguments(**{name: value})
    assert str(err.value).startswith(f"{name}: ") and why in str(err.value)
    with pytest.raises(ConfigError) as err:  # a recipe or a flag of scripts/train.py
        RunConfig.from_flat({name: value})
    assert str(err.value).startswith(f"{name}: ") and why in str(err.value)
    with pytest.raises(ValueError, match=re.escape(why)):
        setattr(TrainingArguments(), name, value)  # validate_assignment: refused on assignment too


@pytest.mark.parametrize("name", REFUSED_OR_ONLY)
def test_a_refused_field_at_its_default_is_accepted(name):
    default = TrainingArguments.model_fields[name].get_default(call_default_factory=True)
    rest = {k: v for k, v in TrainingArguments().to_dict().items() if k != name}
    for value in (default, *SAME_AS_DEFAULT.get(name, ())):
        args = TrainingArguments(**{name: value})
        assert name in args.model_fields_set and getattr(args, name) == value
        assert {k: v for k, v in args.to_dict().items() if k != name} == rest


def test_hfs_parser_sets_refused_fields_and_gets_the_reason():
    parser = HfArgumentParser(Seq2SeqTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--push_to_hub", "false", "--hub_strategy", "every_save"])
    assert (args.push_to_hub, args.hub_strategy) == (False, "every_save")
    with pytest.raises(
        ConfigError, match=f"^push_to_hub: HF's field, refused: {re.escape(REFUSED['push_to_hub'])}$"
    ):
        parser.parse_args_into_dataclasses(["--push_to_hub"])
    with pytest.raises(ConfigError, match="^hub_model_id: HF's field, refused"):
        parser.parse_dict({"hub_model_id": "me/model"})
    # Every field's type is one HF's parser can build a flag for, and the defaults come through.
    (args,) = parser.parse_args_into_dataclasses([])
    assert args.to_dict() == Seq2SeqTrainingArguments().to_dict()


def test_what_hfs_to_dict_writes_for_its_defaults_loads_here():
    written = transformers.TrainingArguments().to_dict()
    written.pop("accelerator_config")  # accelerate's AcceleratorConfig as a dict: refused here
    args = TrainingArguments(**written)
    assert (args.hub_token, args.debug, args.activation_checkpointing) == ("<HUB_TOKEN>", [], False)


def test_to_dict_has_every_hf_field_and_never_a_token():
    values = TrainingArguments().to_dict()
    assert set(hf_defaults(transformers.TrainingArguments)) <= set(values)
    assert values["hub_token"] is None and values["push_to_hub"] is False
    assert TrainingArguments(**values).to_dict() == values
    # A token given at its masked value (what HF writes) stays masked.
    assert TrainingArguments(hub_token="<HUB_TOKEN>").to_dict()["hub_token"] == "<HUB_TOKEN>"


def test_removing_a_field_from_the_refused_list_honours_it(monkeypatch):
    with pytest.raises(ConfigError, match="^save_on_each_node: HF's field, refused"):
        TrainingArguments(save_on_each_node=True)
    monkeypatch.delitem(hf_fields.REFUSED, "save_on_each_node")
    assert TrainingArguments(save_on_each_node=True).save_on_each_node is True


def test_a_checkpoint_saved_before_the_hf_fields_existed_resumes_unchanged(tmp_path):
    """run_config.yaml files written without HF's fields read them as their defaults (no "changed
    settings" on resume), and a run config written now loads back."""
    run = RunConfig.from_flat({"output_dir": str(tmp_path)})
    assert RunConfig.from_flat(yaml.safe_load(yaml.safe_dump(run.to_flat()))) == run
    hf_table = set(hf_fields.HFFields.model_fields)
    older = {k: v for k, v in run.to_flat().items() if k not in hf_table}
    (tmp_path / "run_config.yaml").write_text(yaml.safe_dump(older))
    assert checkpoint.run_config_changes(tmp_path, run) == ([], [])


def test_seq2seq_arguments_keep_the_generation_settings(tmp_path):
    (args,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses(
        [
            "--predict_with_generate", "--generation_max_length", "64", "--generation_num_beams", "4",
            "--sortish_sampler", "--generation_config", str(tmp_path), "--max_steps", "3",
        ]
    )  # fmt: skip
    assert (args.predict_with_generate, args.sortish_sampler, args.max_steps) == (True, True, 3)
    assert (args.generation_max_length, args.generation_num_beams) == (64, 4)
    assert Path(args.generation_config) == tmp_path
    config = GenerationConfig(max_new_tokens=5)
    args = Seq2SeqTrainingArguments(generation_config=config)
    assert args.generation_config is config
    assert args.to_dict()["generation_config"]["max_new_tokens"] == 5
    with pytest.raises(ConfigError, match="^generation_num_beams: "):
        Seq2SeqTrainingArguments(generation_num_beams=0)


def test_importing_the_arguments_loads_neither_torch_nor_transformers():
    code = (
        "import sys, trainer\n"
        "args = trainer.Seq2SeqTrainingArguments(predict_with_generate=True)\n"
        "assert args.push_to_hub is False and trainer.TrainingArguments().hub_model_id is None\n"
        "loaded = [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_docs_list_the_refused_fields_as_the_table_does():
    text = (ROOT / "docs" / "training.md").read_text()
    start, end = "<!-- hf-fields:start -->\n", "\n<!-- hf-fields:end -->"
    section = text[text.index(start) + len(start) : text.index(end)]
    assert section == hf_fields_doc(TrainingArguments), (
        "docs/training.md's HF fields section is out of date; put between its markers the output of: "
        "python -c 'from trainer.args import TrainingArguments; from trainer.args.hf_fields import hf_fields_doc; "
        "print(hf_fields_doc(TrainingArguments))'"
    )


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
