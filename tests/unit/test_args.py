"""Run arguments: recipes, CLI overrides, and the errors bad input gets."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.scaffold import tiny_flags
from trainer.args import RunConfig, TrainingArguments
from trainer.args.recipe import parse_cli, parse_run_config
from trainer.config import Hardware, resolve
from trainer.config.errors import ConfigError


def test_cli_forms_and_launcher_flag():
    flat = parse_cli(
        [
            "--max_steps",
            "50",
            "--learning_rate=3e-4",
            "--bf16",
            "--local_rank=1",
            "--report_to",
            "[tensorboard]",
        ]
    )
    assert flat == {"max_steps": 50, "learning_rate": 3e-4, "bf16": True, "report_to": ["tensorboard"]}
    assert parse_cli(["--local_rank", "0", "--seed", "7"]) == {"seed": 7}


def test_recipe_then_flags_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_steps: 10\nsave_strategy: no\nblock_size: 64\nmodel_type: gpt2\n")
    run = parse_run_config(["--config", str(recipe), "--max_steps", "20", "--eval_strategy", "no"])
    assert run.training.max_steps == 20
    assert run.training.save_strategy == "no" and run.training.eval_strategy == "no"
    assert run.data.block_size == 64 and run.model.model_type == "gpt2"
    assert RunConfig.from_flat(run.to_flat()) == run


def test_unknown_field_names_it_and_suggests():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flat({"max_step": 10, "learnin_rate": 1e-3})
    assert str(err.value) == (
        "max_step: unknown key; did you mean max_steps?\nlearnin_rate: unknown key; did you mean learning_rate?"
    )


def test_wrong_type_names_the_field():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flat({"per_device_train_batch_size": 0})
    assert str(err.value).startswith("per_device_train_batch_size: ")


def test_conflicting_precision_flags():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flat({"bf16": True, "fp16": True})
    assert str(err.value) == "bf16, fp16: both enabled; choose one"
    assert TrainingArguments(bf16=True).requested_precision == "bf16"
    assert TrainingArguments().requested_precision == "auto"


def test_hf_style_keyword_construction():
    args = TrainingArguments(output_dir="o", report_to="none", eval_strategy="steps", eval_steps=5)
    assert args.report_to == [] and args.eval_steps == 5
    assert json.loads(args.to_json_string())["eval_steps"] == 5
    with pytest.raises(ValueError, match="max_step: unknown key; did you mean max_steps"):
        TrainingArguments(max_step=3)


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config: recipe file not found: .*nope.yaml"):
        parse_run_config(["--config", str(tmp_path / "nope.yaml")])


def test_report_to_refuses_integrations_it_does_not_drive():
    supported = "supported: mlflow, tensorboard, wandb, trackio, none, all (those installed)"
    for value, bad in [
        ("comet_ml", "'comet_ml' is"),
        (["tensorboard", "neptune", "wandbb"], "'neptune', 'wandbb' are"),
    ]:
        with pytest.raises(ConfigError) as err:
            RunConfig.from_flat({"report_to": value})
        assert str(err.value) == f"report_to: {bad} not supported; {supported}"
    with pytest.raises(
        ConfigError, match=r"^report_to: \['none', 'tensorboard'\]: 'none' cannot be combined"
    ):
        RunConfig.from_flat({"report_to": ["none", "tensorboard"]})
    with pytest.raises(ValueError, match="'clearml' is not supported"):
        TrainingArguments(report_to="clearml")  # the HF-style door refuses it too


def test_report_to_takes_hf_spellings(monkeypatch):
    assert TrainingArguments(report_to="wandb").report_to == ["wandb"]
    assert TrainingArguments(report_to=["tensorboard", "mlflow"]).report_to == ["tensorboard", "mlflow"]
    assert TrainingArguments(report_to="none").report_to == TrainingArguments(report_to=None).report_to == []
    # As HF's parser: several values after one flag.
    assert parse_run_config(["--report_to", "wandb", "mlflow", "--max_steps", "3"]).training.report_to == [
        "wandb",
        "mlflow",
    ]
    with pytest.raises(ConfigError, match="^4: unexpected argument"):
        parse_run_config(["--max_steps", "3", "4"])  # a single-valued field takes one value
    # "all": every integration whose package is installed, in HF's order.
    installed = {"tensorboard", "wandb"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: find_spec(name) if name in installed else None
    )
    assert TrainingArguments(report_to="all").report_to == ["tensorboard", "wandb"]
    assert TrainingArguments(report_to=["wandb", "all"]).report_to == ["wandb", "tensorboard"]
    assert parse_run_config(["--report_to", "all"]).training.report_to == ["tensorboard", "wandb"]


def test_best_model_arguments_take_hf_defaults():
    assert TrainingArguments().greater_is_better is None
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    assert (args.metric_for_best_model, args.greater_is_better) == ("loss", False)
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="acc", greater_is_better=False).greater_is_better is False
    # The best model is reloaded from a checkpoint saved when it was evaluated.
    with pytest.raises(
        ConfigError, match="^load_best_model_at_end, eval_strategy, save_strategy: eval_strategy=no"
    ):
        RunConfig.from_flat({"load_best_model_at_end": True, "save_strategy": "steps"})
    with pytest.raises(
        ConfigError, match=r"^load_best_model_at_end, save_steps: 30 is not a multiple of .* \(20\)"
    ):
        RunConfig.from_flat(
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 20, "save_steps": 30}
        )
    RunConfig.from_flat({"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "epoch"})


def test_a_deepspeed_config_flag_outranks_the_recipe(tmp_path):
    """`--deepspeed zero3.json` on a ZeRO-2 recipe runs what the file says; flags still win."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("zero_stage: 2\nper_device_train_batch_size: 4\nmax_grad_norm: 0.5\nprecision: auto\n")
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"train_micro_batch_size_per_gpu": 16, "gradient_clipping": "auto", "bf16": {"enabled": true},'
        ' "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}'
    )
    args = parse_run_config(["--config", str(recipe), "--deepspeed", str(ds)]).training
    assert (args.zero_stage, args.per_device_train_batch_size, args.offload_param) == (3, 16, "cpu")
    assert args.bf16 and args.precision == "bf16"
    assert args.max_grad_norm == 0.5  # "auto" in the file: the recipe's value stands
    flagged = parse_run_config(
        ["--config", str(recipe), "--deepspeed", str(ds), "--zero_stage", "1"]
    ).training
    assert flagged.zero_stage == 1  # a flag is kept, and resolve reports the contradiction


def test_a_deepspeed_config_in_the_recipe_is_checked_against_it(tmp_path):
    """Both in one recipe: the user wrote both, so a contradiction is an error naming both."""
    from trainer.config import Hardware, resolve

    recipe = tmp_path / "r.yaml"
    recipe.write_text("zero_stage: 2\ndeepspeed: zero3\n")
    args = parse_run_config(["--config", str(recipe)]).training
    with pytest.raises(ConfigError, match="zero_optimization.stage: 3 contradicts zero_stage=2"):
        resolve(args, world_size=1, hardware=Hardware.cpu())


def test_training_arguments_in_code_take_unset_fields_from_the_deepspeed_config():
    args = TrainingArguments(deepspeed="zero2_offload", per_device_train_batch_size=2)
    assert (args.zero_stage, args.offload_optimizer, args.per_device_train_batch_size) == (2, "cpu", 2)
    assert TrainingArguments(deepspeed={"zero_optimization": {"stage": "auto"}}).zero_stage == 0


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--lora_r", "8", "--use_rslora", "true"], "error: lora_r, use_rslora: LoRA settings without use_peft"),
        (["--tile_tokens", "256", "--tiled_loss", "false"], "error: tile_tokens, tiled_loss, tiled_mlp: a tile size with nothing tiled"),
        (["--nvme_path", "/tmp/nvme"], "error: nvme_path: set, but nothing is offloaded to NVMe"),
    ],
)  # fmt: skip
def test_a_setting_without_its_switch_is_refused_before_the_run(tmp_path, capsys, flags, error):
    """`trainer train` refuses, in one line naming both, a setting its switch would have used; nothing
    is written. (Were it accepted, the tiny run would train one step and exit 0.)"""
    from trainer.cli.train import EXIT_BAD_INPUT, main

    out = tmp_path / "out"
    assert (
        main([*tiny_flags(max_steps=1, save_steps=1, eval_steps=1), *flags, "--output_dir", str(out)])
        == EXIT_BAD_INPUT
    )
    stderr = capsys.readouterr().err.strip()
    assert stderr.startswith(error) and "\n" not in stderr
    assert not out.exists()


def test_preference_pairs_are_not_streamed():
    with pytest.raises(
        ConfigError, match=r"streaming, objective: preference pairs \(dpo\) are read up front"
    ):
        parse_run_config(["--objective", "dpo", "--streaming", "true", "--max_steps", "2"])
    assert parse_run_config(
        ["--streaming", "true", "--max_steps", "2", "--data_format", "sft"]
    ).data.streaming


def test_the_same_settings_with_their_switches_are_accepted():
    lora = parse_run_config(["--use_peft", "true", "--model_name_or_path", "base", "--lora_r", "8"])
    assert lora.model.lora_r == 8
    assert parse_run_config(["--tile_tokens", "256"]).training.tile_tokens == 256  # tiled_loss auto
    assert parse_run_config(["--tile_tokens", "256", "--tiled_loss", "false", "--tiled_mlp", "true"])
    # The run's rules pass with NVMe offload on (the DeepSpeed dict gets the path).
    run = parse_run_config(["--nvme_path", "/tmp/nvme", "--zero_stage", "2", "--offload_optimizer", "nvme"])
    resolved = resolve(run, 1, Hardware.cpu())
    assert resolved["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/tmp/nvme"
