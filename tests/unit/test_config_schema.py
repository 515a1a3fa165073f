"""The schema itself: unknown, removed and renamed keys; "auto"; number spellings; both stage-3 names."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, DSConfig, validate
from trainer.config.base import ConfigModel, nested_model
from trainer.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from trainer.config.schema import REMOVED_TOP_LEVEL
from trainer.config.zero import STAGE3_KNOBS, ZeroConfig

BASE = {"train_micro_batch_size_per_gpu": 2}


def problems(data: dict, world_size: int | None = None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        validate(data, world_size)
    return err.value.problems


def test_unknown_top_level_key_suggests_the_nearest():
    assert problems({**BASE, "zero_optimisation": {"stage": 2}}) == [
        ("zero_optimisation", "unknown key; did you mean zero_optimization?")
    ]


def test_error_text_is_one_line_per_problem():
    with pytest.raises(ConfigError) as err:
        validate({**BASE, "zero_optimisation": {}, "trian_batch_size": 4})
    assert str(err.value).splitlines() == [
        "zero_optimisation: unknown key; did you mean zero_optimization?",
        "trian_batch_size: unknown key; did you mean train_batch_size?",
    ]


@pytest.mark.parametrize(
    "section, key, path, suggestion",
    [
        (
            "activation_checkpointing",
            "partition_activation",
            "activation_checkpointing",
            "partition_activations",
        ),
        ("checkpoint", "load_universial", "checkpoint", "load_universal"),
        ("data_types", "grad_acum_dtype", "data_types", "grad_accum_dtype"),
        ("flops_profiler", "enabeld", "flops_profiler", "enabled"),
        ("pipeline", "stage", "pipeline", "stages"),
        ("aio", "queue_dept", "aio", "queue_depth"),
        ("comms_logger", "verbos", "comms_logger", "verbose"),
        ("tensorboard", "output_pth", "tensorboard", "output_path"),
    ],
)
def test_unknown_keys_inside_sections_deepspeed_ignores(section, key, path, suggestion):
    assert problems({**BASE, section: {key: True}}) == [
        (f"{path}.{key}", f"unknown key; did you mean {suggestion}?")
    ]


def test_unknown_key_deep_in_zero_offload():
    data = {**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}
    assert problems(data) == [
        ("zero_optimization.offload_param.pin_memroy", "unknown key; did you mean pin_memory?")
    ]


def test_unknown_key_without_a_close_match():
    assert problems({**BASE, "fp16": {"xyzzy": 1}}) == [("fp16.xyzzy", "unknown key")]


def test_unknown_optimizer_param_names_the_type():
    data = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betaz": [0.9, 0.95]}}}
    assert problems(data) == [("optimizer.params.betaz", "unknown key; did you mean betas? (for type AdamW)")]


def test_param_of_another_optimizer_is_unknown_for_this_one():
    data = {**BASE, "optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}
    assert problems(data) == [("optimizer.params.momentum", "unknown key (for type Adam)")]


def test_max_grad_norm_in_optimizer_params_points_to_gradient_clipping():
    data = {**BASE, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}
    assert problems(data) == [
        (
            "optimizer.params.max_grad_norm",
            "not an optimizer parameter in DeepSpeed (it raises on it); use the top-level gradient_clipping",
        )
    ]


def test_unknown_scheduler_param():
    data = {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_step": 10}}}
    assert problems(data) == [
        ("scheduler.params.warmup_step", "unknown key; did you mean warmup_type? (for type WarmupLR)")
    ]


@pytest.mark.parametrize("key", sorted(REMOVED_TOP_LEVEL))
def test_removed_top_level_keys(key):
    [(path, msg)] = problems({**BASE, key: {}})
    assert path == key
    assert msg == f"removed in DeepSpeed 0.19: {REMOVED_TOP_LEVEL[key]}"


def test_removed_keys_name_the_reason():
    assert problems({**BASE, "amp": {"enabled": True}}) == [
        ("amp", "removed in DeepSpeed 0.19: NVIDIA Apex AMP was removed; use fp16 or bf16")
    ]


@pytest.mark.parametrize("key", sorted(ZeroConfig.removed_keys))
def test_removed_zero_keys(key):
    assert problems({**BASE, "zero_optimization": {"stage": 3, key: 1}}) == [
        (f"zero_optimization.{key}", f"removed in DeepSpeed 0.19: {ZeroConfig.removed_keys[key]}")
    ]


def test_renamed_and_deprecated_keys_say_what_to_use():
    data = {**BASE, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 3, "cpu_offload": True}}
    assert problems(data) == [
        ("zero_optimization.cpu_offload", 'deprecated; use offload_optimizer: {"device": "cpu"}'),
        ("bfloat16", "renamed; use bf16"),
    ]


def test_auto_is_refused_by_the_schema_itself():
    data = {**BASE, "zero_optimization": {"stage": "auto"}, "bf16": {"enabled": "auto"}}
    msg = '"auto" is only a placeholder; resolve the config against a run first (plain DeepSpeed would silently use its default here)'
    assert problems(data) == [("zero_optimization.stage", msg), ("bf16.enabled", msg)]


def test_numbers_written_as_strings_are_numbers():
    data = {
        "train_micro_batch_size_per_gpu": "4",
        "gradient_clipping": "0.5",
        "zero_optimization": {"stage": "3", "reduce_bucket_size": "5e8", "stage3_max_live_parameters": 1e9},
        "fp16": {"enabled": True, "loss_scale": "0", "initial_scale_power": "16.0"},
    }
    out = validate(data).to_dict()
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["gradient_clipping"] == 0.5
    assert out["zero_optimization"] == {
        "stage": 3,
        "reduce_bucket_size": 500_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
    }
    assert out["fp16"] == {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16}


def test_wrong_types_name_the_path_and_value():
    data = {
        "train_micro_batch_size_per_gpu": True,
        "gradient_clipping": "abc",
        "zero_optimization": {"stage": 2.5},
    }
    assert problems(data) == [
        ("train_micro_batch_size_per_gpu", "expected a number, got true"),
        (
            "gradient_clipping",
            "Input should be a valid number, unable to parse string as a number; got 'abc'",
        ),
        (
            "zero_optimization.stage",
            "Input should be a valid integer, got a number with a fractional part; got 2.5",
        ),
    ]


def test_out_of_range_values():
    data = {**BASE, "zero_optimization": {"stage": 4}, "fp16": {"loss_scale": -1}}
    assert problems(data) == [
        ("zero_optimization.stage", "Input should be less than or equal to 3; got 4"),
        ("fp16.loss_scale", "Input should be greater than or equal to 0; got -1"),
    ]


@pytest.mark.parametrize("knob", STAGE3_KNOBS)
def test_each_stage3_knob_accepts_both_names_and_writes_the_prefixed_one(knob):
    value = True if ZeroConfig.model_fields[knob].annotation is bool else 7
    short = validate({**BASE, "zero_optimization": {"stage": 3, knob: value}}).to_dict()
    long = validate({**BASE, "zero_optimization": {"stage": 3, f"stage3_{knob}": value}}).to_dict()
    assert short == long
    assert long["zero_optimization"][f"stage3_{knob}"] == value


def test_both_names_of_a_stage3_knob_are_refused():
    data = {
        **BASE,
        "zero_optimization": {"stage": 3, "max_live_parameters": 1, "stage3_max_live_parameters": 2},
    }
    assert problems(data) == [
        (
            "zero_optimization.stage3_max_live_parameters, zero_optimization.max_live_parameters",
            "both names given; use one",
        )
    ]


def test_error_for_a_short_stage3_name_uses_the_name_written():
    data = {**BASE, "zero_optimization": {"stage": 3, "prefetch_bucket_size": -5}}
    assert problems(data) == [
        ("zero_optimization.prefetch_bucket_size", "Input should be greater than or equal to 0; got -5")
    ]


def test_type_names_in_any_case_are_written_as_deepspeed_needs():
    data = {
        **BASE,
        "optimizer": {"type": "sgd", "params": {"lr": 0.1}},
        "scheduler": {"type": "warmuplr", "params": {}},
        "checkpoint": {"tag_validation": "fail"},
        "communication_data_type": "BF16",
        "data_types": {"grad_accum_dtype": "float32"},
    }
    out = validate(data).to_dict()
    assert out["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}}
    assert out["scheduler"] == {"type": "WarmupLR", "params": {}}
    assert out["checkpoint"] == {"tag_validation": "FAIL"}
    assert out["communication_data_type"] == "bf16"
    assert out["data_types"] == {"grad_accum_dtype": "fp32"}


def test_unknown_optimizer_type_lists_the_choices():
    [(path, msg)] = problems({**BASE, "optimizer": {"type": "Adamm"}})
    assert path == "optimizer.type"
    assert msg.startswith("Input should be 'Adam', 'AdamW', 'Lamb', 'Lion', 'Adagrad', 'SGD'")
    assert msg.endswith("got 'Adamm'")


def test_to_dict_writes_only_what_was_given():
    data = {**BASE, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    assert validate(data).to_dict() == data


def test_steps_per_print_infinity_means_never():
    assert "steps_per_print" not in validate({**BASE, "steps_per_print": "inf"}).to_dict()
    assert "steps_per_print" not in validate({**BASE, "steps_per_print": float("inf")}).to_dict()


def test_not_an_object():
    assert problems([1, 2]) == [("", "a DeepSpeed config must be a JSON object, got list")]


def _models(root: type[ConfigModel]) -> list[type[ConfigModel]]:
    found = [root]
    for field in root.model_fields.values():
        child = nested_model(field.annotation)
        if child is not None:
            found += _models(child)
    return found


ALL_MODELS = sorted(
    {*_models(DSConfig), *OPTIMIZER_PARAMS.values(), *SCHEDULER_PARAMS.values()}, key=lambda m: m.__name__
)


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_every_field_has_a_description_and_every_model_a_docstring(model):
    assert model.__doc__ and model.__doc__.strip()
    for name, field in model.model_fields.items():
        assert field.description, f"{model.__name__}.{name} has no description"
    assert model.model_config["extra"] == "forbid"
