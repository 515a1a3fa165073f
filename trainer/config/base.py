"""The base of every DeepSpeed config model, and the translation of validation errors into problems.

DeepSpeed reads most of its config with ``dict.get``, so a typo or a stray ``"auto"`` is silently
ignored. Every model here forbids unknown keys, and each error is reported as ``(key_path, message)``
with the path the user wrote (``zero_optimization.offload_optimizer.ratio``) and, for a misspelled
key, the nearest valid one.
"""

from __future__ import annotations

import json
import math
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from trainer.config.errors import unknown_key_message

Problem = tuple[str, str]

# The error type our own cross-field rules raise; its ctx carries the problems with relative paths.
RULE_ERROR = "config_rule"

AUTO_MESSAGE = (
    '"auto" is only a placeholder; resolve the config against a run first '
    "(plain DeepSpeed would silently use its default here)"
)


def rule_error(problems: list[Problem]) -> PydanticCustomError:
    """An error for one or more broken rules. Paths are relative to the model that raises it.

    A path may name several keys, separated by ``", "``; each gets the model's location as prefix.
    """
    text = "; ".join(f"{path}: {msg}" if path else msg for path, msg in problems)
    return PydanticCustomError(RULE_ERROR, "{text}", {"text": text, "problems": list(problems)})


def _strip_optional(annotation: Any) -> list[Any]:
    """The non-None members of a (possibly Optional / Annotated) annotation."""
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def numeric_kind(annotation: Any) -> type | None:
    """``int`` or ``float`` when a field holds a plain number, else None."""
    members = _strip_optional(annotation)
    if len(members) == 1 and members[0] in (int, float):
        return members[0]
    return None


def nested_model(annotation: Any) -> type[ConfigModel] | None:
    """The config model a field holds, if any (``X``, ``X | None``)."""
    for member in _strip_optional(annotation):
        if isinstance(member, type) and issubclass(member, ConfigModel):
            return member
    return None


class ConfigModel(BaseModel):
    """A section of the DeepSpeed JSON. Subclasses list keys DeepSpeed removed or renamed."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    # key -> why DeepSpeed 0.19 removed it
    removed_keys: ClassVar[dict[str, str]] = {}
    # key -> a message for keys that belong elsewhere or were renamed
    key_hints: ClassVar[dict[str, str]] = {}

    @classmethod
    def known_keys(cls) -> list[str]:
        keys = []
        for name, field in cls.model_fields.items():
            keys.append(name)
            if field.alias and field.alias != name:
                keys.append(field.alias)
        return keys

    @classmethod
    def unknown_key(cls, key: str) -> str:
        if key in cls.removed_keys:
            return f"removed in DeepSpeed 0.19: {cls.removed_keys[key]}"
        if key in cls.key_hints:
            return cls.key_hints[key]
        return unknown_key_message(key, cls.known_keys())

    @field_validator("*", mode="before")
    @classmethod
    def _plain_values(cls, value: Any, info: ValidationInfo) -> Any:
        """Reject ``"auto"`` and booleans-as-numbers; read numbers written as strings ("5e8")."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            raise ValueError(AUTO_MESSAGE)
        kind = numeric_kind(cls.model_fields[info.field_name].annotation) if info.field_name else None
        if kind is None:
            return value
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                return value  # pydantic reports the type error with the value
            if kind is int and math.isfinite(number) and number.is_integer():
                return int(number)
            return number
        return value

    def to_dict(self) -> dict[str, Any]:
        """The DeepSpeed JSON for this section: DeepSpeed's key names, only the keys that were given."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)


def _model_at(root: type[ConfigModel], parts: tuple[str, ...]) -> type[ConfigModel] | None:
    """The model that validated the mapping at ``parts`` below ``root`` (None if it is not a model)."""
    current: type[ConfigModel] | None = root
    for part in parts:
        if current is None:
            return None
        field = next(
            (f for name, f in current.model_fields.items() if part in (name, f.alias)),
            None,
        )
        current = nested_model(field.annotation) if field else None
    return current


def _join(prefix: tuple[str, ...], path: str) -> str:
    base = ".".join(prefix)
    if not path:
        return base
    if not base:
        return path
    return ", ".join(f"{base}.{part}" for part in path.split(", "))


_SHOW_INPUT = (
    "int_parsing",
    "int_from_float",
    "float_parsing",
    "bool_parsing",
    "literal_error",
    "int_type",
    "float_type",
    "bool_type",
    "string_type",
    "list_type",
    "tuple_type",
    "dict_type",
    "model_type",
    "finite_number",
)


def _message(error: dict[str, Any]) -> str:
    kind = error["type"]
    if kind == "missing":
        return "required"
    msg = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if kind in _SHOW_INPUT or kind.startswith(("greater_than", "less_than")):
        shown = repr(error.get("input"))
        msg = f"{msg}; got {shown if len(shown) <= 60 else shown[:57] + '...'}"
    return msg


def problems_from_error(err: ValidationError, root: type[ConfigModel], prefix: str = "") -> list[Problem]:
    """Turn a pydantic error into ``(key_path, message)`` pairs, one per problem, in order."""
    start = tuple(prefix.split(".")) if prefix else ()
    problems: list[Problem] = []
    for error in err.errors(include_url=False):
        loc = tuple(str(p) for p in error["loc"])
        if error["type"] == RULE_ERROR:
            for path, msg in error["ctx"]["problems"]:
                problems.append((_join(start + loc, path), msg))
        elif error["type"] == "extra_forbidden":
            model = _model_at(root, loc[:-1])
            msg = model.unknown_key(loc[-1]) if model else "unknown key"
            problems.append((_join(start + loc, ""), msg))
        else:
            problems.append((_join(start + loc, ""), _message(error)))
    return dedupe(problems)


def dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[Problem] = set()
    out = []
    for problem in problems:
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out


def literal_values(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of a ``Literal`` field (through Optional), else ()."""
    for member in _strip_optional(annotation):
        if get_origin(member) is Literal:
            return get_args(member)
    return ()


ARGS_NOTE = "in the training arguments"


def show_value(value: Any) -> str:
    """A value as a config shows it (JSON; a tuple as a list)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)
