"""A run's arguments from a recipe (flat YAML) and ``--field value`` flags, the ``--help`` generated
from the schema, and ``run_config.yaml``: how ``RunConfig`` meets files and command lines.
"""

from __future__ import annotations

import itertools
import json
import logging
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml

from trainer.args import hf_fields
from trainer.args.run import SECTIONS, RunConfig
from trainer.args.training import TrainingArguments, stated_by_deepspeed
from trainer.config.errors import ConfigError
from trainer.config.files import stated_optimizer
from trainer.config.reference import type_name
from trainer.objectives import OBJECTIVES

logger = logging.getLogger(__name__)


_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}


# Fields that take several values on the command line (``--report_to wandb mlflow``), as HF's parser.
_LIST_FIELDS = {
    name
    for model in SECTIONS.values()
    for name, field in model.model_fields.items()
    if list in {typing.get_origin(t) for t in (field.annotation, *typing.get_args(field.annotation))}
}


def _parse_value(text: str) -> Any:
    """A CLI value as YAML would read it: numbers, booleans, lists, dicts; otherwise the string.
    YAML 1.1's yes/no/on/off stay strings (``--save_strategy no``)."""
    if text.lower() in _YAML11_BOOLS:
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)  # YAML 1.1 reads 3e-4 (no dot) as a string
    except ValueError:
        pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_cli(argv: list[str]) -> dict[str, Any]:
    """``--config FILE`` plus ``--field value`` / ``--field=value`` / bare ``--flag`` pairs."""
    recipe, flags = _recipe_and_flags(argv)
    return {**recipe, **flags}


def _recipe_and_flags(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    flat: dict[str, Any] = {}
    config_path = None
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError([(token, "unexpected argument; fields are given as --field value")])
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name == "local_rank":  # injected by the deepspeed launcher; distributed.py reads LOCAL_RANK
            i += 1 if eq else 2
            continue
        values = [value]
        if not eq:
            values = list(itertools.takewhile(lambda t: not t.startswith("--"), argv[i + 1 :]))
            if len(values) > 1 and name not in _LIST_FIELDS:
                values = values[:1]  # the next token is refused as an unexpected argument
            i += len(values)
            value = values[0] if values else "true"
        i += 1
        if name == "config":
            config_path = value
        elif len(values) > 1:  # HF's nargs="+": --report_to wandb mlflow
            flat[name] = [_parse_value(v) for v in values]
        else:
            flat[name] = _parse_value(value)
    return (load_recipe(config_path) if config_path else {}), flat


def load_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("config", f"recipe file not found: {path}")])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError([(str(path), f"invalid YAML: {err}")]) from None
    if not isinstance(data, dict):
        raise ConfigError([(str(path), "a recipe must be a mapping of field: value")])
    if isinstance(data.get("deepspeed"), str) and data["deepspeed"].endswith(".json"):
        # Relative DeepSpeed paths in a recipe are relative to the recipe itself.
        ds = Path(data["deepspeed"])
        if not ds.is_absolute() and not ds.exists() and (path.parent / ds).exists():
            data["deepspeed"] = str(path.parent / ds)
    return data


def parse_run_config(argv: list[str]) -> RunConfig:
    """The run from a recipe and flags. Flags win over the recipe, and a DeepSpeed config given as
    a flag wins over the recipe's values for what it states (``--deepspeed zero3.json`` on a ZeRO-2
    recipe runs ZeRO-3); a flag that contradicts it is still an error."""
    recipe, flags = _recipe_and_flags(argv)
    _recipe_optimizer_gives_way(recipe, flags)
    if flags.get("deepspeed") is not None:
        stated = stated_by_deepspeed(flags["deepspeed"])
        for name in [k for k in recipe if k in stated and k not in flags]:
            if recipe[name] != stated[name]:
                logger.info(
                    "%s: %s from the DeepSpeed config replaces the recipe's %s",
                    name,
                    stated[name],
                    recipe[name],
                )
            del recipe[name]
    return RunConfig.from_flat({**recipe, **flags})


def _muon_cannot(flags: dict[str, Any]) -> list[str]:
    """What the flags (and a DeepSpeed config they give) ask for that Muon does not run with."""
    given = {
        **(stated_by_deepspeed(flags["deepspeed"]) if flags.get("deepspeed") is not None else {}),
        **flags,
    }
    checks = {
        "offload_optimizer": lambda v: v == "nvme",
        "tensor_parallel_size": lambda v: int(v) > 1,
        "pipeline_parallel_size": lambda v: int(v) > 1,
    }
    found = [f"{key} {given[key]}" for key, bad in checks.items() if key in given and bad(given[key])]
    optimizer = stated_optimizer(flags["deepspeed"]) if flags.get("deepspeed") is not None else None
    if optimizer not in (None, "Muon"):
        found.append(f"the DeepSpeed config's {optimizer} optimizer")
    return found


def _recipe_optimizer_gives_way(recipe: dict[str, Any], flags: dict[str, Any]) -> None:
    """A recipe's optimizer settings are the recipe's optimizer's: an ``optim`` flag naming another
    drops the recipe's ``optim_args`` with it. The recipe's ``optim: muon`` (the default job's) gives way to
    AdamW, with a warning, where the flags ask for what Muon does not run with (optimizer offload to
    NVMe, tensor or pipeline parallelism, a DeepSpeed config's own optimizer); asked for
    on the command line, Muon is refused there instead, naming the keys."""
    if "optim" in flags:
        if "optim_args" not in flags and flags["optim"] != recipe.get("optim"):
            recipe.pop("optim_args", None)
        return
    if recipe.get("optim") != "muon" or not (reasons := _muon_cannot(flags)):
        return
    logger.warning(
        "optim: the recipe's muon gives way to adamw_torch (Muon does not run with %s)", ", ".join(reasons)
    )
    recipe.pop("optim")
    recipe.pop("optim_args", None)


HELP_FLAGS = ("-h", "--help")

_HELP_INTRO = """\
Train a model. Every field below is set in a YAML recipe (--config) as `field: value` or on the
command line as --field value (or --field=value); a bare --flag means true, and a flag wins over
the recipe. Values are read as YAML: --report_to [tensorboard, wandb], --model_config_overrides
'{num_hidden_layers: 2}'. The defaults shown are the schema's; scripts/train.py without --config
starts from scripts/recipes/default.yaml."""


def _default_text(field: Any) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    return json.dumps(value)


def objective_help() -> list[tuple[type, str]]:
    """The objectives' own argument classes, from the most shared to the most specific (each with
    the objectives that read its fields): every class between an objective's config and
    ``TrainingArguments``, as the registry's configs inherit them."""
    found: dict[type, list[str]] = {}
    for name, entry in OBJECTIVES.items():
        for cls in reversed(entry.config_class().__mro__):
            if issubclass(cls, TrainingArguments) and cls is not TrainingArguments:
                found.setdefault(cls, []).append(name)
    return [(cls, " and ".join(", ".join(names).rsplit(", ", 1))) for cls, names in found.items()]


def help_recipe(argv: list[str]) -> tuple[str, dict[str, Any]] | None:
    """The recipe ``--help`` runs with (``--config``), as (its path, its fields); None without one,
    or when it does not load (the run itself then says why)."""
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    config = config or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config is None:
        return None
    try:
        return config, load_recipe(config)
    except ConfigError:
        return None


def run_help(prog: str = "scripts/train.py", recipe: tuple[str, dict[str, Any]] | None = None) -> str:
    """The ``--help`` text: every run field with its type, default and description, from the schema;
    HF's fields that are refused unless left at their default come after the sections, under their
    own heading, and the preference objectives' own fields last. ``recipe``: the ``--config`` the
    command runs with (``scripts/train.py`` without one runs the default recipe): a field it sets
    shows the recipe's value beside the schema's default."""
    path, values = recipe or ("", {})
    lines = [f"usage: {prog} [--config RECIPE.yaml] [--field value ...]", "", _HELP_INTRO]
    groups = []
    for section, model in SECTIONS.items():
        fields = model.model_fields.items()
        refused = [(name, field) for name, field in fields if hf_fields.refused_note(name)]
        groups.append((f"{section} arguments ({model.__name__}):", [f for f in fields if f not in refused]))
        groups.append(("HF's fields refused unless left at their default:", refused))
    for config, objectives in objective_help():
        inherited = config.__mro__[1].model_fields
        own = [(name, field) for name, field in config.model_fields.items() if name not in inherited]
        groups.append((f"with --objective {objectives} ({config.__name__}):", own))
    for heading, group in groups:
        lines += ["", heading] if group else []
        for name, field in group:
            given = f"; {path}: {json.dumps(values[name])}" if name in values else ""
            lines.append(
                f"  --{name} {type_name(field.annotation, ' | ')} (default: {_default_text(field)}{given})"
            )
            text = " ".join(filter(None, (field.description, hf_fields.refused_note(name))))
            lines += textwrap.wrap(text, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def dump_run_config(run: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(run.to_flat(), sort_keys=False))
