"""``docs/config.md``, generated from the schema's field descriptions (a test keeps it current)."""

from __future__ import annotations

import json
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic_core import PydanticUndefined

from trainer.config.base import ConfigModel, nested_model
from trainer.config.optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from trainer.config.presets import PRECISIONS, PRESETS
from trainer.config.schema import DSConfig
from trainer.config.zero import ZeroConfig

INTRO = """\
# DeepSpeed config reference

<!-- Generated from trainer/config/ by `trainer ds-config reference -o docs/config.md`; do not edit. -->

Every DeepSpeed config this project writes or reads goes through one typed schema
(`trainer/config/`). Unknown keys, wrong types, out-of-range values and conflicting settings are
errors that name the key path, reported before any model is loaded:

```
$ trainer ds-config validate my_ds.json --world-size 3
my_ds.json: 2 problems
zero_optimisation: unknown key; did you mean zero_optimization?
train_batch_size, train_micro_batch_size_per_gpu: 8 = 2 × g × 3 has no integer solution for gradient_accumulation_steps g at data-parallel world size 3
```

## Bringing an existing DeepSpeed JSON

Configs written for HF Trainer, Accelerate, LLaMA-Factory or axolotl work as they are: pass the
file as `deepspeed` in a recipe, or `--deepspeed path/to/ds.json` on the command line. On the way in:

- `"auto"` is replaced by the run's value (table below). An `"auto"` the run cannot determine is an
  error naming the key; plain DeepSpeed would silently use its default instead (`stage: "auto"`
  becomes stage 0).
- The file outranks defaults and the recipe: a training argument you did not set takes the value
  the file states (`train_micro_batch_size_per_gpu` → `per_device_train_batch_size`,
  `gradient_accumulation_steps`, `gradient_clipping` → `max_grad_norm`, the ZeRO stage and offload
  devices, `pipeline.stages`, `optimizer.params.lr`/`weight_decay`, and `bf16`/`fp16` → precision).
  So `--deepspeed ds_configs/zero3_fp32.json` on a ZeRO-2 recipe runs ZeRO-3 with the file's batch;
  only a recipe that names the file itself is held to agree with it.
- An explicit value that contradicts an argument you set (a flag, a field in code, or a field of
  the recipe that names the file) is an error showing both values, e.g.
  `train_micro_batch_size_per_gpu: 4 contradicts per_device_train_batch_size=8 in the training
  arguments`. Remove the key, set it to `"auto"`, or make the two agree.
- Numbers written as strings (`"5e8"`) are read as numbers; ZeRO-3 knobs may be written with or
  without the `stage3_` prefix, but not both ways at once.
- Optimizer and scheduler names match in any case (`adamw`, `sgd`) and are written the way
  DeepSpeed needs them (`AdamW`, `SGD`).
- Keys DeepSpeed 0.19 removed (`elasticity`, `amp`, `sparse_attention`, ...) are errors that say so.

Check a file without training: `trainer ds-config validate FILE [--world-size N] [--config recipe.yaml]`.
It exits 0, or 1 listing every problem as `key.path: message`. With `--config`, `"auto"` values and
contradictions are checked against that recipe's training arguments; without it, `"auto"` values are
filled from the default arguments. `--resolved` prints the concrete config.

| key | `"auto"` resolves from |
|---|---|
| `train_micro_batch_size_per_gpu` | `per_device_train_batch_size` |
| `gradient_accumulation_steps` | `gradient_accumulation_steps` |
| `train_batch_size` | micro batch × accumulation steps × data-parallel world size |
| `gradient_clipping` | `max_grad_norm` |
| `fp16.enabled`, `bf16.enabled` | `precision` / `bf16` / `fp16`; `auto` means bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU |
| `zero_optimization.stage` | `zero_stage` |
| `zero_optimization.offload_*.device`, `nvme_path` | `offload_optimizer`, `offload_param`, `nvme_path` |
| `zero_optimization.reduce_bucket_size` | hidden size h: h² |
| `zero_optimization.stage3_prefetch_bucket_size` | 0.9 · h² |
| `zero_optimization.stage3_param_persistence_threshold` | 10 · h |
| `optimizer.type` | `optim` |
| `optimizer.params.lr`, `betas`, `eps`, `weight_decay` | `learning_rate`, `adam_beta1`/`adam_beta2`, `adam_epsilon`, `weight_decay` |
| `scheduler.type` | `lr_scheduler_type` |
| `scheduler.params.warmup_max_lr` | `learning_rate` |
| `scheduler.params.warmup_min_lr`, `warmup_min_ratio` | 0 |
| `scheduler.params.warmup_num_steps` | `warmup_steps`, or `warmup_ratio` × total steps |
| `scheduler.params.total_num_steps` | `max_steps`, or the steps the trainer computes from the data |
| `pipeline.stages` | `pipeline_parallel_size` |
| `data_types.keep_in_fp32_modules` | left out: DeepSpeed's own automatic choice |

Missing keys that the run determines are filled in the same way, so a config never disagrees with
the training arguments. With no `deepspeed` setting at all, the config is generated from the
shortcuts `zero_stage`, `offload_optimizer`, `offload_param`, `nvme_path` and `pipeline_parallel_size`.

## Rules checked before anything loads

- `fp16.enabled` and `bf16.enabled` both true.
- `offload_param` without ZeRO stage 3; `offload_optimizer` with stage 0; an offload `ratio` below 1
  without stage 3; an `nvme` device without `nvme_path`.
- `train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel
  world size`, including the case DeepSpeed gets wrong by integer division (8 = 2 × g × 3).
- `pipeline` with ZeRO stage 2 or 3, or with `wall_clock_breakdown` but no `steps_per_print`.
- An optimizer ZeRO has not been tested with (SGD, Lamb, the mup ones) without
  `zero_allow_untested_optimizer`; `adam_w_mode: false` with type AdamW (DeepSpeed ignores it);
  Lamb with a static fp16 loss scale.
- A schedule whose `total_num_steps` is below its `warmup_num_steps`.
- At resolve time: fp16 (or bf16) on hardware that cannot run it, and `aio.use_gds` without CUDA.

Of these keys, DeepSpeed's own parser checks only some: `python scripts/ds_key_coverage.py` gives
each key a wrong type and a misspelling in turn and reports which ones DeepSpeed refuses.
"""


def type_name(annotation: Any, bar: str = " \\| ") -> str:
    """A field's type in words (``"fp32" | "bf16"``, ``int | null``, ``list of str``); ``bar`` separates
    alternatives (escaped for a markdown table by default, plain ``" | "`` for CLI help)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return bar.join(json.dumps(v) for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        text = bar.join(type_name(m, bar) for m in members)
        return f"{text}{bar}null" if len(members) < len(get_args(annotation)) else text
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0], bar)}"
    if origin is tuple:
        return "[" + ", ".join(type_name(a, bar) for a in get_args(annotation)) + "]"
    if origin is dict:
        return "object"
    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "unset"
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _table(model: type[ConfigModel], prefix: str = "") -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        also = f" (or `{name}`)" if field.alias and field.alias != name else ""
        rows.append(
            f"| `{prefix}{key}`{also} | {type_name(field.annotation)} | {_default(field)} | {field.description} |"
        )
    return rows


def _doc(model: type[ConfigModel]) -> str:
    return (model.__doc__ or "").strip().replace("``", "`")


def _sections(model: type[ConfigModel], path: str) -> list[str]:
    lines = [
        f"### `{path}`" if path else "### Top level",
        "",
        _doc(model),
        "",
        *_table(model),
        "",
    ]
    for name, field in model.model_fields.items():
        child = nested_model(field.annotation)
        if child is not None:
            lines += _sections(child, f"{path}.{field.alias or name}" if path else field.alias or name)
    return lines


def _params(title: str, table: dict[str, type[ConfigModel]]) -> list[str]:
    lines = [f"### `{title}.params` by type", ""]
    by_model: dict[type[ConfigModel], list[str]] = {}
    for kind, model in table.items():
        by_model.setdefault(model, []).append(kind)
    for model, names in by_model.items():
        lines += [f"#### {', '.join(names)}", "", _doc(model), "", *_table(model), ""]
    return lines


def _removed() -> list[str]:
    rows = ["| key | why |", "|---|---|"]
    for key, why in DSConfig.removed_keys.items():
        rows.append(f"| `{key}` | {why} |")
    for key, why in ZeroConfig.removed_keys.items():
        rows.append(f"| `zero_optimization.{key}` | {why} |")
    return rows


def _presets() -> list[str]:
    rows = [
        "| preset | ZeRO stage | optimizer offload | parameter offload | what it is |",
        "|---|---|---|---|---|",
    ]
    for p in PRESETS.values():
        rows.append(f"| `{p.name}` | {p.stage} | {p.offload_optimizer} | {p.offload_param} | {p.summary} |")
    files = ", ".join(f"`{p}`" for p in PRECISIONS)
    return [
        "## Presets",
        "",
        "Use one by name (`deepspeed: zero3` in a recipe); batch sizes and precision then come from the run.",
        f"`ds_configs/<preset>_<precision>.json` holds each for precision {files}, written by",
        "`trainer ds-config presets` with the training arguments' default batch sizes; never edit them by hand.",
        "The `zero3_nvme` files point `nvme_path` at `/local_nvme`: change it, or use the preset by name",
        "with `nvme_path` in the training arguments.",
        "",
        *rows,
        "",
    ]


def render_reference() -> str:
    lines = [INTRO, *_presets(), "## Keys", ""]
    lines += _sections(DSConfig, "")
    lines += _params("optimizer", OPTIMIZER_PARAMS)
    lines += _params("scheduler", SCHEDULER_PARAMS)
    lines += ["## Removed in DeepSpeed 0.19", "", *_removed(), ""]
    return "\n".join(lines)
