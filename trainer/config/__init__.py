"""Typed DeepSpeed config: schema, presets, and resolution of a run into a concrete DeepSpeed dict.

The bottom layer: it imports pydantic and the standard library, never torch, deepspeed or
``trainer.args``. ``trainer.args`` imports it; functions here read the training arguments the caller
passes (``trainer.config.arguments`` says what they read).

Public API::

    validate(data, world_size=None) -> DSConfig        # raises ConfigError listing every problem
    resolve(run, world_size, hardware, *, hidden_size=None, total_steps=None, data_parallel=None) -> dict
    parallel_sizes(run) -> (pipeline stages, sequence-, tensor- and expert-parallel sizes) as resolve settles them
    for_zero_init(config) -> the dict zero.Init builds a ZeRO-3 model with; custom_tensor_plan(run)
    generate(zero_stage=, precision=, micro_batch=, grad_accum=, world_size=, ...) -> dict
    load_deepspeed_json(path) -> dict
    preset_config(name, precision, args) -> dict; PRESETS; PRECISIONS; write_presets(dir, args)
    Hardware.cpu() / Hardware.cuda(name, capability)
"""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.config.files import load_deepspeed_json
from trainer.config.hardware import Hardware
from trainer.config.parallel import custom_tensor_plan, for_zero_init, parallel_sizes, tensor_size_of
from trainer.config.presets import PRECISIONS, PRESETS, preset_config, write_presets
from trainer.config.resolution import check, deepspeed_schedules, generate, resolve
from trainer.config.schema import DSConfig, batch_problems, validate

__all__ = [
    "PRECISIONS",
    "PRESETS",
    "ConfigError",
    "DSConfig",
    "Hardware",
    "batch_problems",
    "check",
    "deepspeed_schedules",
    "generate",
    "load_deepspeed_json",
    "custom_tensor_plan",
    "for_zero_init",
    "parallel_sizes",
    "preset_config",
    "resolve",
    "tensor_size_of",
    "validate",
    "write_presets",
]
