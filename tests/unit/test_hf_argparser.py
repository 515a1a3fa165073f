"""TrainingArguments through transformers' own HfArgumentParser, as HF's example scripts use it:
flags, JSON and YAML files, the dataclass views, and what stays ours (flags left out stay unset,
refusals and did-you-mean)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest
import yaml
from transformers import HfArgumentParser

from trainer import TrainingArguments
from trainer.args import DataArguments, ModelArguments, RunConfig


@dataclass
class ScriptModelArguments:
    """A script's own dataclass, as run_clm.py declares one."""

    config_overrides: str | None = field(default=None, metadata={"help": "k=v pairs"})
    model_type: str = "llama"


def parse(argv):
    return HfArgumentParser((ScriptModelArguments, TrainingArguments)).parse_args_into_dataclasses(argv)


def test_training_arguments_is_a_dataclass_to_hf_and_dataclasses():
    assert dataclasses.is_dataclass(TrainingArguments)
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert names == set(TrainingArguments.model_fields)
    args = TrainingArguments(output_dir="o", learning_rate=3e-4)
    assert dataclasses.asdict(args)["learning_rate"] == 3e-4
    assert dataclasses.replace(args, max_steps=7).max_steps == 7


def test_flags_parse_with_hfs_types_and_only_given_flags_are_set():
    model_args, args = parse(
        [
            "--output_dir", "out", "--learning-rate", "1e-4", "--bf16", "--zero_stage", "3",
            "--report_to", "wandb", "mlflow", "--lr_scheduler_type", "cosine_with_min_lr",
            "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}', "--resume_from_checkpoint", "false",
            "--no_dataloader_pin_memory", "--eval_steps", "5", "--config_overrides", "n_embd=10",
            "--local_rank=1",
        ]
    )  # fmt: skip
    assert model_args.config_overrides == "n_embd=10"
    assert isinstance(args, TrainingArguments)
    assert (args.learning_rate, args.bf16, args.zero_stage, args.eval_steps) == (1e-4, True, 3, 5)
    assert args.report_to == ["wandb", "mlflow"]
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert args.resume_from_checkpoint is None and args.dataloader_pin_memory is False
    # Flags left out stay unset (a True default keeps HF's --no_<flag> pair, so it arrives as given).
    true_defaults = {name for name, f in TrainingArguments.model_fields.items() if f.default is True}
    assert true_defaults >= {"log_on_each_node", "remove_unused_columns", "skip_memory_metrics"}
    assert args.model_fields_set - true_defaults == {
        "output_dir", "learning_rate", "bf16", "zero_stage", "report_to", "lr_scheduler_type",
        "lr_scheduler_kwargs", "resume_from_checkpoint", "eval_steps", "local_rank",
    }  # fmt: skip
    assert args.max_steps == -1 and args.per_device_train_batch_size == 8  # the defaults


def test_a_deepspeed_file_fills_the_flags_left_out(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}))
    _, args = parse(["--deepspeed", str(ds), "--learning_rate", "1e-3"])
    assert (args.per_device_train_batch_size, args.zero_stage, args.learning_rate) == (4, 3, 1e-3)


def test_json_and_yaml_files(tmp_path):
    values = {
        "output_dir": "o",
        "max_steps": 9,
        "lr_scheduler_kwargs": {"min_lr": 1e-5},
        "config_overrides": "x=1",
    }
    (tmp_path / "a.json").write_text(json.dumps(values))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(values))
    parser = HfArgumentParser((ScriptModelArguments, TrainingArguments))
    for parsed in (parser.parse_json_file(tmp_path / "a.json"), parser.parse_yaml_file(tmp_path / "a.yaml")):
        model_args, args = parsed
        assert model_args.config_overrides == "x=1"
        assert (args.max_steps, args.lr_scheduler_kwargs) == (9, {"min_lr": 1e-5})
        assert args.model_fields_set == {"output_dir", "max_steps", "lr_scheduler_kwargs"}


def test_our_three_argument_models_parse_together():
    model_args, data_args, args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses(
        [
            "--model_config_overrides",
            '{"hidden_size": 64}',
            "--block_size",
            "32",
            "--no_packing",
            "--max_steps",
            "3",
        ]
    )
    run = RunConfig(model=model_args, data=data_args, training=args)
    assert run.model.model_config_overrides == {"hidden_size": 64}
    assert (run.data.block_size, run.data.packing, run.training.max_steps) == (32, False, 3)


def test_bad_values_keep_our_messages():
    with pytest.raises(ValueError, match="^lr_scheduler_kwargs: not a JSON object"):
        parse(["--lr_scheduler_kwargs", "min_lr=1"])
    with pytest.raises(ValueError, match="^debug: .*not supported"):
        TrainingArguments(debug="underflow_overflow")
    # A refused HF field is a field (at HF's default), so the parser hands it over and gets our
    # reason; HfArgumentParser itself refuses keys that are no field, naming each.
    with pytest.raises(ValueError, match="^debug: .*not supported"):
        HfArgumentParser(TrainingArguments).parse_dict({"debug": "underflow_overflow"})
    with pytest.raises(ValueError, match="not used by the HfArgumentParser: \\['learning_rat'\\]"):
        HfArgumentParser(TrainingArguments).parse_dict({"learning_rat": True})
    with pytest.raises(ValueError, match=r"^learning_rat: unknown key; did you mean learning_rate\?"):
        TrainingArguments(learning_rat=1.0)
