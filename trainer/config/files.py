"""A DeepSpeed config as the user gives it (a dict, a preset name or a JSON file): reading it, the
training arguments it states, and the dict a run's resolution starts from (``base_config``).
Nothing here imports torch or deepspeed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config.arguments import TrainingArgs
from trainer.config.errors import ConfigError
from trainer.config.presets import PRESETS, preset_base, zero_section

MISSING: Any = object()


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def get_path(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def precision_of(config: dict[str, Any] | None) -> str:
    """What a resolved DeepSpeed config trains in: bf16, fp16 or fp32."""
    return next((p for p in ("bf16", "fp16") if (config or {}).get(p, {}).get("enabled") is True), "fp32")


def load_deepspeed_json(path: str | Path) -> dict[str, Any]:
    """Read a DeepSpeed JSON file; duplicate keys are an error, as they are in DeepSpeed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("deepspeed", f"DeepSpeed config file not found: {path}")])

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ConfigError([(str(path), f"duplicate key {', '.join(dupes)}")])
        return dict(pairs)

    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError([(str(path), f"invalid JSON: {err}")]) from None
    if not isinstance(data, dict):
        raise ConfigError([(str(path), "a DeepSpeed config must be a JSON object")])
    return data


def load_source(source: str | dict[str, Any], nvme_path: str | None = None) -> dict[str, Any]:
    """A DeepSpeed config given as a dict, a preset name or a JSON path, as a fresh dict."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # a deep copy: the caller's dict is never changed
    if source in PRESETS:
        return preset_base(source, nvme_path)
    return load_deepspeed_json(source)


# Training arguments that a DeepSpeed config can state outright, and where it states them.
STATED_ARGUMENTS = {
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "offload_param": "zero_optimization.offload_param.device",
    "pipeline_parallel_size": "pipeline.stages",
    "sequence_parallel_size": "sequence_parallel_size",
    "tensor_parallel_size": "tensor_parallel.autotp_size",
    "learning_rate": "optimizer.params.lr",
    "weight_decay": "optimizer.params.weight_decay",
}


def stated_arguments(source: str | dict[str, Any]) -> dict[str, Any]:
    """The training arguments a DeepSpeed config states with a concrete value (not ``"auto"``):
    a run takes them from the config wherever its own arguments leave them unset. Empty when the
    config cannot be read (``resolve`` reports that, naming the file)."""
    try:
        data = load_source(source)
    except ConfigError:
        return {}
    stated = {arg: get_path(data, path) for arg, path in STATED_ARGUMENTS.items()}
    stated = {arg: value for arg, value in stated.items() if value is not MISSING and not is_auto(value)}
    on = [p for p in ("bf16", "fp16") if get_path(data, f"{p}.enabled") is True]
    if len(on) == 1:
        stated["precision"] = on[0]
    return stated


def stated_optimizer(source: str | dict[str, Any]) -> str | None:
    """The optimizer type a DeepSpeed config names (None: no section, ``"auto"``, or unreadable)."""
    try:
        kind = get_path(load_source(source), "optimizer.type")
    except ConfigError:
        return None
    return kind if isinstance(kind, str) and not is_auto(kind) else None


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def base_config(args: TrainingArgs) -> tuple[dict[str, Any], bool]:
    """The config to start from, and whether its explicit values must agree with the arguments."""
    if args.deepspeed is None:
        data: dict[str, Any] = {
            "zero_optimization": zero_section(
                args.zero_stage, args.offload_optimizer, args.offload_param, args.nvme_path
            )
        }
        return data, False
    return load_source(args.deepspeed, args.nvme_path), True
