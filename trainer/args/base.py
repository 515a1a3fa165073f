"""What every argument model shares: the pydantic base that turns a bad key or value into one line
naming it (with a did-you-mean for a misspelling), and the value helpers the models use.

It sits under ``args.py``, ``args_model_data.py`` and ``hf_fields.py`` so that each of them can
build on it without importing another.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from contextvars import ContextVar
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from trainer.args.hf import Unstated, dataclass_fields
from trainer.config.errors import ConfigError, unknown_key_message
from trainer.config.files import stated_arguments

PRECISION_FIELDS = ("precision", "bf16", "fp16")
# Set while a RunConfig validates its sections (pydantic calls their __init__ then too): a section
# then skips what only arguments built on their own do (TrainingArguments' ZeRO-3 registration).
IN_RUN_CONFIG: ContextVar[bool] = ContextVar("in_run_config", default=False)


class ArgsModel(BaseModel):
    """An argument model: unknown keys refused, every problem reported as ``key: message``, and a
    dataclass face for ``HfArgumentParser``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, /, **data: Any) -> None:
        # HfArgumentParser hands over every field: those its user left out come as Unstated, and stay unset.
        try:
            super().__init__(**{k: v for k, v in data.items() if not isinstance(v, Unstated)})
        except ValidationError as err:
            raise ConfigError(validation_problems(err)) from None  # one line per problem, naming the key

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.__dataclass_fields__ = dataclass_fields(cls)  # a dataclass to HfArgumentParser

    @model_validator(mode="before")
    @classmethod
    def _unknown_keys(cls, data: Any) -> Any:
        """pydantic's own message for an extra key names no alternative; this one suggests the
        nearest field."""
        if isinstance(data, dict):
            known = set(cls.model_fields)
            for key in data:
                if key not in known:
                    raise ValueError(f"{key}: {unknown_key_message(key, known)}")
        return data

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def json_object(value: Any) -> Any:
    """A mapping field's value: a dict as it is, None as empty, a string as a JSON object (what HF's
    parser hands over for ``--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'``)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"not a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object, like '{\"key\": 1}'")
    return value


def stated_by_deepspeed(source: Any) -> dict[str, Any]:
    """What a DeepSpeed config states of the training arguments; precision also rules the flags."""
    stated = stated_arguments(source) if isinstance(source, str | dict) else {}
    if "precision" in stated:
        stated.update(bf16=stated["precision"] == "bf16", fp16=stated["precision"] == "fp16")
    return stated


def validation_problems(err: ValidationError, sections: Collection[str] = ()) -> list[tuple[str, str]]:
    """``(key path, message)`` per problem; ``sections`` (a RunConfig's) are left out of the path,
    since every field name belongs to one section only."""
    problems = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if str(p) not in sections]
        msg = e["msg"].removeprefix("Value error, ")
        # Our own validators already lead with the key path ("key: message").
        if not loc and ": " in msg:
            path, msg = msg.split(": ", 1)
            problems.append((path, msg))
        else:
            problems.append((".".join(loc), msg))
    return problems
