"""Instruction data: which format a dataset is in, and each of its rows as a chat or a plain pair.

A format is known by its columns (``FORMAT_COLUMNS``). ``data_format: sft`` tells it from the
columns a dataset has; any other name is taken as said. A row becomes either a :class:`Chat` (the
messages, and which of them carry the loss), rendered later with a chat template, or a
:class:`Pair` (a prompt and a completion used verbatim). A row that cannot be read raises
:class:`RowProblem` with a one-line reason; the builder reports it with the row's index.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainer.data.sources import DataError, require_columns

# Format name -> the columns it needs. Alpaca's `input` is optional (see OPTIONAL_COLUMNS).
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "prompt_response": ("prompt", "response"),
}
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {"alpaca": ("input",)}
# ShareGPT's speaker names -> the roles a chat template knows.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class RowProblem(ValueError):
    """One row that cannot be used; the message is one line without the row index."""


@dataclass
class Chat:
    """A conversation; ``trained[i]`` says whether message ``i``'s content carries the loss."""

    messages: list[dict[str, str]]
    trained: list[bool]


@dataclass
class Pair:
    """A prompt and a completion, used verbatim (no template); the completion carries the loss."""

    prompt: str
    completion: str


def known_formats(text_column: str = "text") -> str:
    described = [
        f"{name} ({', '.join(cols + tuple(f'optional {c}' for c in OPTIONAL_COLUMNS.get(name, ())))})"
        for name, cols in FORMAT_COLUMNS.items()
    ]
    return "; ".join([*described, f"text ({text_column}; data_format: text)"])


def resolve_format(data_format: str, columns: list[str], source: str, text_column: str = "text") -> str:
    """The concrete format of a dataset with ``columns``: ``data_format`` itself, or for ``sft``
    the one instruction format whose columns are all there (else one DataError)."""
    if data_format == "text":
        return "text"
    if data_format != "sft":
        require_columns(columns, "data_format", list(FORMAT_COLUMNS[data_format]), source)
        return data_format
    fits = [name for name, cols in FORMAT_COLUMNS.items() if all(c in columns for c in cols)]
    if len(fits) == 1:
        return fits[0]
    why = f"they fit {' and '.join(fits)}, name one" if fits else "no instruction format fits them"
    raise DataError(
        [
            (
                "data_format",
                f"sft: cannot tell the format of {source} from its columns ({', '.join(columns)}): "
                f"{why}. Known formats: {known_formats(text_column)}",
            )
        ]
    )


def format_columns(fmt: str, columns: list[str]) -> list[str]:
    """The columns a format reads: its own, plus the optional ones the dataset has."""
    return [*FORMAT_COLUMNS[fmt], *(c for c in OPTIONAL_COLUMNS.get(fmt, ()) if c in columns)]


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    raise RowProblem(f"{what} is {'missing' if value is None else 'not a string'}")


def _messages(
    value: Any, what: str, role_key: str, content_key: str, roles: dict[str, str]
) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        state = "missing" if value is None else "empty" if value == [] else "not a list of messages"
        raise RowProblem(f"{what} is {state}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowProblem(f"{what}[{i}] is not a message")
        role = _text(message.get(role_key), f"{what}[{i}].{role_key}")
        if role not in roles:
            raise RowProblem(f"{what}[{i}]: unknown role {role!r} (known: {', '.join(roles)})")
        out.append(
            {"role": roles[role], "content": _text(message.get(content_key), f"{what}[{i}].{content_key}")}
        )
    return out


def _chat(messages: list[dict[str, str]], prompt_len: int = 0) -> Chat:
    """Assistant messages after the first ``prompt_len`` messages carry the loss; an assistant
    message that opens the conversation answers nothing, so it is context."""
    trained = [i >= max(prompt_len, 1) and m["role"] == "assistant" for i, m in enumerate(messages)]
    if not any(trained):
        raise RowProblem("no assistant message to train on (one that follows a prompt)")
    return Chat(messages, trained)


def _prompt_completion(prompt: Any, completion: Any) -> Chat | Pair:
    if isinstance(prompt, list) or isinstance(completion, list):
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise RowProblem("prompt and completion must both be strings or both lists of messages")
        roles = {r: r for r in MESSAGE_ROLES}
        before = _messages(prompt, "prompt", "role", "content", roles)
        return _chat(before + _messages(completion, "completion", "role", "content", roles), len(before))
    return Pair(_text(prompt, "prompt"), _text(completion, "completion"))


def parse_row(fmt: str, row: dict[str, Any]) -> Chat | Pair:
    """One row of an instruction format as a Chat or a Pair; RowProblem when it cannot be read."""
    if fmt == "alpaca":
        instruction, extra = _text(row.get("instruction"), "instruction"), row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise RowProblem("input is not a string")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        output = _text(row.get("output"), "output")
        return _chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])
    if fmt == "sharegpt":
        return _chat(_messages(row.get("conversations"), "conversations", "from", "value", SHAREGPT_ROLES))
    if fmt == "messages":
        roles = {r: r for r in MESSAGE_ROLES}
        return _chat(_messages(row.get("messages"), "messages", "role", "content", roles))
    if fmt == "prompt_completion":
        return _prompt_completion(row.get("prompt"), row.get("completion"))
    if fmt == "prompt_response":
        return Pair(_text(row.get("prompt"), "prompt"), _text(row.get("response"), "response"))
    raise ValueError(f"not an instruction format: {fmt}")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):  # a list of messages
        for message in value:
            if isinstance(message, dict):
                yield from (v for k in ("content", "value") if isinstance(v := message.get(k), str))
                role = message.get("role") or SHAREGPT_ROLES.get(message.get("from") or "")
                if isinstance(role, str):  # the default template's marker, so it costs few tokens
                    yield f"<|{role}|>\n"


def row_strings(fmt: str, row: dict[str, Any]) -> Iterator[str]:
    """One instruction row's raw strings, as ``iter_texts`` gives a set's."""
    for col in format_columns(fmt, list(row)):
        yield from _strings(row[col])
    if fmt == "alpaca":
        yield from ("<|user|>\n", "<|assistant|>\n")


def iter_texts(
    ds: Any, data_format: str, text_column: str, source: str = "dataset", batch_size: int = 256
) -> Iterator[str]:
    """The raw strings of a dataset, for training a tokenizer on it (its columns checked first).

    Chats also give the role markers of the default chat template (``<|user|>``), so a tokenizer
    trained on them spends few tokens on the template.
    """
    fmt = resolve_format(data_format, ds.column_names, source, text_column)
    if fmt == "text":
        require_columns(ds.column_names, "text_column", [text_column], source)
    cols = [text_column] if fmt == "text" else format_columns(fmt, ds.column_names)
    for batch in ds.select_columns(cols).iter(batch_size=batch_size):
        for col in cols:
            for value in batch[col]:
                yield from _strings(value)
        if fmt == "alpaca":
            yield from ("<|user|>\n", "<|assistant|>\n") * len(batch[cols[0]])
