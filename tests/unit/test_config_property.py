"""Property tests with hypothesis.

Valid configs are drawn from the schema itself (each field's type and bounds), with the
cross-field rules honoured; each must round-trip through JSON, and DeepSpeed's own parser must
accept it and settle on the same batch sizes, stage and precision. Invalid configs are valid ones
with one mutation (a misspelled key, a wrong type, an out-of-range value); each must give a
ConfigError that names the mutated path, never another exception.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, get_origin

import hypothesis.strategies as st
import pytest
from annotated_types import Ge, Gt, Le, Lt
from hypothesis import HealthCheck, assume, given, settings

from tests.helpers.deepspeed_config_parser import deepspeed_parse
from trainer.config import ConfigError, DSConfig, validate
from trainer.config.base import ConfigModel, _model_at, _strip_optional, literal_values
from trainer.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, ZERO_TESTED_OPTIMIZERS
from trainer.config.precision import BF16Config, DataTypesConfig, FP16Config
from trainer.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    PipelineConfig,
    TensorBoardConfig,
    WandbConfig,
)
from trainer.config.zero import STAGE3_KNOBS, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

# More examples for a longer hunt: CONFIG_PROPERTY_EXAMPLES=2000 pytest tests/unit/test_config_property.py
EXAMPLES = int(os.environ.get("CONFIG_PROPERTY_EXAMPLES", "80"))
# "auto" is refused everywhere: DeepSpeed's own models drop it silently, even for text fields.
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_/", min_size=1, max_size=12).filter(
    lambda s: s != "auto"
)
BIG = 10**9


def _bounds(field: Any) -> tuple[float | None, float | None, bool, bool]:
    lo = hi = None
    lo_open = hi_open = False
    for item in field.metadata:
        if isinstance(item, Ge):
            lo = item.ge
        elif isinstance(item, Gt):
            lo, lo_open = item.gt, True
        elif isinstance(item, Le):
            hi = item.le
        elif isinstance(item, Lt):
            hi, hi_open = item.lt, True
    return lo, hi, lo_open, hi_open


def value_strategy(field: Any) -> st.SearchStrategy | None:
    """Values the schema accepts for a leaf field, from its type and bounds; None for sections."""
    choices = literal_values(field.annotation)
    if choices:
        return st.sampled_from(choices)
    kind = _strip_optional(field.annotation)[0]
    lo, hi, lo_open, hi_open = _bounds(field)
    if kind is bool:
        return st.booleans()
    if kind is int:
        low = -10 if lo is None else int(lo) + lo_open
        high = BIG if hi is None else int(hi) - hi_open
        return st.integers(low, min(high, BIG))
    if kind is float:
        return st.floats(
            min_value=-10.0 if lo is None else lo,
            max_value=1e6 if hi is None else hi,
            exclude_min=lo_open,
            exclude_max=hi_open,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind is str:
        return NAMES
    if get_origin(kind) is list:
        return st.lists(NAMES, max_size=3)
    if get_origin(kind) is tuple:  # betas
        return st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)).map(list)
    return None


def section(
    model: type[ConfigModel], exclude: tuple[str, ...] = (), required: bool = False
) -> st.SearchStrategy:
    """A random subset of a model's leaf fields (required fields always present)."""
    must, may = {}, {}
    for name, field in model.model_fields.items():
        strategy = value_strategy(field)
        if name in exclude or strategy is None:
            continue
        (must if field.is_required() else may)[field.alias or name] = strategy
    return st.fixed_dictionaries(must, optional=may)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def zero_sections(draw, stage: int) -> dict[str, Any]:
    zero = {
        "stage": stage,
        **draw(section(ZeroConfig, exclude=("stage", "offload_param", "offload_optimizer"))),
    }
    for knob in STAGE3_KNOBS:  # either spelling DeepSpeed accepts
        if f"stage3_{knob}" in zero and draw(st.booleans()):
            zero[knob] = zero.pop(f"stage3_{knob}")
    if stage >= 1 and draw(st.booleans()):
        block = draw(section(OffloadOptimizerConfig, exclude=("device", "nvme_path", "ratio")))
        block["device"] = draw(st.sampled_from(["none", "cpu", "nvme"]))
        if block["device"] == "nvme":
            block["nvme_path"] = "/nvme/" + draw(NAMES)
        if stage == 3 and draw(st.booleans()):
            block["ratio"] = draw(st.floats(0.0, 1.0))
        zero["offload_optimizer"] = block
    if stage == 3 and draw(st.booleans()):
        block = draw(section(OffloadParamConfig, exclude=("device", "nvme_path")))
        block["device"] = draw(st.sampled_from(["none", "cpu", "nvme"]))
        if block["device"] == "nvme":
            block["nvme_path"] = "/nvme/" + draw(NAMES)
        zero["offload_param"] = block
    return zero


@st.composite
def optimizers(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(OPTIMIZER_PARAMS)))
    params = draw(section(OPTIMIZER_PARAMS[kind]))
    if kind == "AdamW":
        params.pop("adam_w_mode", None)
    if params.get("nesterov") and (params.get("momentum", 0) <= 0 or params.get("dampening", 0) != 0):
        params["nesterov"] = False
    return {"type": kind, "params": params}


@st.composite
def schedulers(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(SCHEDULER_PARAMS)))
    params = draw(section(SCHEDULER_PARAMS[kind]))
    if "total_num_steps" in params:
        params["total_num_steps"] = max(params["total_num_steps"], params.get("warmup_num_steps", 1000))
    fields = SCHEDULER_PARAMS[kind].model_fields
    for low, high in (("cycle_min_lr", "cycle_max_lr"), ("cycle_min_mom", "cycle_max_mom")):
        if low in params or high in params:
            pair = [params.get(low, fields[low].default), params.get(high, fields[high].default)]
            params[low], params[high] = min(pair), max(pair)
    return {"type": kind, "params": params}


@st.composite
def batch_keys(draw, dp: int) -> dict[str, int]:
    mbs, gas = draw(st.integers(1, 16)), draw(st.integers(1, 8))
    form = draw(st.sampled_from(["all", "tbs+mbs", "tbs+gas", "mbs+gas", "mbs", "tbs"]))
    values = {
        "train_batch_size": mbs * gas * dp,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
    }
    if form == "tbs":
        return {"train_batch_size": mbs * dp}
    if form == "all":
        return values
    keep = {
        "tbs+mbs": ("train_batch_size", "train_micro_batch_size_per_gpu"),
        "tbs+gas": ("train_batch_size", "gradient_accumulation_steps"),
        "mbs+gas": ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
        "mbs": ("train_micro_batch_size_per_gpu",),
    }[form]
    return {k: values[k] for k in keep}


OPTIONAL_SECTIONS = {
    "activation_checkpointing": section(ActivationCheckpointingConfig),
    "checkpoint": section(CheckpointConfig),
    "aio": section(AioConfig, exclude=("use_gds",)),  # GDS needs CUDA; resolution checks it
    "flops_profiler": section(FlopsProfilerConfig),
    "comms_logger": section(CommsLoggerConfig),
    "tensorboard": section(TensorBoardConfig),
    "csv_monitor": section(CsvMonitorConfig),
    "wandb": section(WandbConfig),
    "data_types": section(DataTypesConfig),
}


@st.composite
def valid_configs(draw) -> tuple[dict[str, Any], int, int]:
    """(config, world size, data-parallel size)."""
    world_size = draw(st.integers(1, 8))
    stage = draw(st.integers(0, 3))
    data: dict[str, Any] = draw(
        section(
            DSConfig,
            # Sequence parallelism changes the data-parallel size DeepSpeed's parser is run at; its
            # batch arithmetic has its own test (test_config_rules.py).
            exclude=(
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "sequence_parallel_size",
            ),
        )  # fmt: skip
    )
    stages = 1
    if stage <= 1 and draw(st.booleans()):
        stages = draw(st.sampled_from(_divisors(world_size)))
        data["pipeline"] = {**draw(section(PipelineConfig, exclude=("stages",))), "stages": stages}
        if data.get("wall_clock_breakdown") and "steps_per_print" not in data:
            data["steps_per_print"] = draw(st.integers(1, 100))
    dp = world_size // stages
    data.update(draw(batch_keys(dp)))
    if draw(st.booleans()) or stage:
        data["zero_optimization"] = draw(zero_sections(stage))
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    if precision == "fp16" or draw(st.booleans()):
        data["fp16"] = {**draw(section(FP16Config, exclude=("enabled",))), "enabled": precision == "fp16"}
    if precision == "bf16" or draw(st.booleans()):
        bf16 = {**draw(section(BF16Config, exclude=("enabled",))), "enabled": precision == "bf16"}
        if stage == 0:
            bf16.pop("bf16_master_weights_and_grads", None)
            bf16.pop("bf16_optimizer_states", None)
        if bf16.get("bf16_optimizer_states"):
            bf16["bf16_master_weights_and_grads"] = True
        data["bf16"] = bf16
    if draw(st.booleans()):
        data["optimizer"] = draw(optimizers())
        if data["optimizer"]["type"] == "Lamb" and "fp16" in data:
            data["fp16"]["loss_scale"] = 0
        if data["optimizer"]["type"] == "Lamb":  # a GPU kernel: refused under optimizer offload
            data.get("zero_optimization", {}).pop("offload_optimizer", None)
        if stage >= 1 and data["optimizer"]["type"] not in ZERO_TESTED_OPTIMIZERS:
            data["zero_allow_untested_optimizer"] = True
    if draw(st.booleans()):
        data["scheduler"] = draw(schedulers())
    for name, strategy in OPTIONAL_SECTIONS.items():
        if draw(st.booleans()):
            data[name] = draw(strategy)
    return data, world_size, dp


def _expected_batch(config: DSConfig, dp: int) -> list[int]:
    tbs, mbs, gas = (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )
    if mbs is None:
        gas = gas or 1
        mbs = tbs // (gas * dp)
    if gas is None:
        gas = tbs // (mbs * dp) if tbs else 1
    return [mbs * gas * dp, mbs, gas]


def test_valid_configs_round_trip_and_deepspeed_accepts_them():
    drawn: list[tuple[dict[str, Any], int]] = []
    expected: list[tuple[list[int], int, str]] = []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(valid_configs())
    def check(case):
        data, world_size, dp = case
        config = validate(data, world_size)
        out = config.to_dict()
        again = validate(json.loads(json.dumps(out)), world_size)
        assert again.to_dict() == out
        assert again == config
        assert not [v for _, v in _walk(out) if isinstance(v, str) and v.lower() == "auto"]
        drawn.append((out, dp))
        expected.append((_expected_batch(config, dp), config.zero_stage, config.precision))

    check()
    results = deepspeed_parse(drawn)
    for (config, dp), result, (batch, stage, precision) in zip(drawn, results, expected, strict=True):
        assert result["error"] is None, (
            f"DeepSpeed refused {json.dumps(config)} at dp={dp}: {result['error']}"
        )
        assert result["batch"] == batch, json.dumps(config)
        assert result["stage"] == stage
        assert {"fp16": result["fp16"], "bf16": result["bf16"]} == {
            "fp16": precision == "fp16",
            "bf16": precision == "bf16",
        }


# --- invalid mutations -----------------------------------------------------------------------------


def _walk(node: dict[str, Any], prefix: tuple[str, ...] = ()):
    for key, value in node.items():
        yield prefix + (key,), value
        if isinstance(value, dict):
            yield from _walk(value, prefix + (key,))


def _container_model(data: dict[str, Any], parts: tuple[str, ...]) -> type[ConfigModel] | None:
    if parts in (("optimizer", "params"), ("scheduler", "params")):
        table = OPTIMIZER_PARAMS if parts[0] == "optimizer" else SCHEDULER_PARAMS
        return table.get(data[parts[0]]["type"])
    return _model_at(DSConfig, parts)


def _field(model: type[ConfigModel], key: str) -> Any:
    return next(f for name, f in model.model_fields.items() if key in (name, f.alias))


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _typo(draw, key: str) -> str:
    i = draw(st.integers(0, len(key) - 1))
    op = draw(st.sampled_from(["drop", "swap", "insert", "replace"]))
    letter = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz"))
    if op == "drop" and len(key) > 1:
        return key[:i] + key[i + 1 :]
    if op == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    if op == "insert":
        return key[:i] + letter + key[i:]
    return key[:i] + letter + key[i + 1 :]


def _out_of_range(field: Any, value: Any) -> Any | None:
    lo, hi, lo_open, hi_open = _bounds(field)
    if lo is not None:
        return lo if lo_open else (lo - 1 if isinstance(value, int) else lo - 0.5)
    if hi is not None:
        return hi if hi_open else (hi + 1 if isinstance(value, int) else hi + 0.5)
    return None


@settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs(), st.data())
def test_invalid_mutations_give_an_error_naming_the_path(case, data):
    config, world_size, _ = case
    config = json.loads(json.dumps(config))
    paths = list(_walk(config))
    assume(paths)
    path, value = data.draw(st.sampled_from(paths))
    container = _container_model(config, path[:-1])
    assume(container is not None)
    kind = data.draw(st.sampled_from(["typo", "wrong_type", "out_of_range"]))
    if kind == "typo":
        new_key = _typo(data.draw, path[-1])
        parent = config
        for part in path[:-1]:
            parent = parent[part]
        assume(new_key not in container.known_keys() and new_key not in parent)
        renamed = {(new_key if k == path[-1] else k): v for k, v in parent.items()}
        parent.clear()
        parent.update(renamed)
        expected = ".".join(path[:-1] + (new_key,))
    elif kind == "wrong_type":
        assume(not isinstance(value, dict))
        number = isinstance(value, int | float) and not isinstance(value, bool)
        _set(
            config,
            path,
            data.draw(st.sampled_from(["not-a-number", {"nested": 1}] if number else [{"nested": 1}])),
        )
        expected = ".".join(path)
    else:
        assume(isinstance(value, int | float) and not isinstance(value, bool))
        bad = _out_of_range(_field(container, path[-1]), value)
        assume(bad is not None and math.isfinite(bad))
        _set(config, path, bad)
        expected = ".".join(path)

    with pytest.raises(ConfigError) as err:
        validate(config, world_size)
    named = [key for problem_path, _ in err.value.problems for key in problem_path.split(", ")]
    assert expected in named, (kind, expected, err.value.problems)
