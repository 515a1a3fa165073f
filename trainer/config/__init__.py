"""Typed DeepSpeed config: schema, presets, and resolution of a run into a concrete DeepSpeed dict.

``trainer.args`` imports ``trainer.config.errors``, and resolution reads ``trainer.args``; names
here load on first use so neither import order can cycle.

Public API::

    validate(data, world_size=None) -> DSConfig        # raises ConfigError listing every problem
    resolve(run, world_size, hardware, *, hidden_size=None, total_steps=None) -> dict
    generate(zero_stage=, precision=, micro_batch=, grad_accum=, world_size=, ...) -> dict
    load_deepspeed_json(path) -> dict
    preset_config(name, precision) -> dict; PRESETS; PRECISIONS; write_presets(dir)
    Hardware.cpu() / Hardware.cuda(name, capability)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "ConfigError": "trainer.config.errors",
    "DSConfig": "trainer.config.schema",
    "validate": "trainer.config.schema",
    "batch_problems": "trainer.config.schema",
    "Hardware": "trainer.config.hardware",
    "resolve": "trainer.config.resolution",
    "check": "trainer.config.resolution",
    "generate": "trainer.config.resolution",
    "load_deepspeed_json": "trainer.config.files",
    "PRESETS": "trainer.config.presets",
    "PRECISIONS": "trainer.config.presets",
    "preset_config": "trainer.config.presets",
    "write_presets": "trainer.config.presets",
}
__all__ = [
    "PRECISIONS",
    "PRESETS",
    "ConfigError",
    "DSConfig",
    "Hardware",
    "batch_problems",
    "check",
    "generate",
    "load_deepspeed_json",
    "preset_config",
    "resolve",
    "validate",
    "write_presets",
]

if TYPE_CHECKING:
    from trainer.config.errors import ConfigError
    from trainer.config.files import load_deepspeed_json
    from trainer.config.hardware import Hardware
    from trainer.config.presets import PRECISIONS, PRESETS, preset_config, write_presets
    from trainer.config.resolution import check, generate, resolve
    from trainer.config.schema import DSConfig, batch_problems, validate


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer.config' has no attribute {name!r}")
