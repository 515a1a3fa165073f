"""Errors raised for bad configuration, with the key path and a fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """One or more problems in a run or DeepSpeed config.

    ``problems`` is a list of ``(key_path, message)``; ``str()`` renders one line per problem as
    ``key.path: message`` so the CLI can print it as-is.
    """

    def __init__(self, problems: list[tuple[str, str]] | str, path: str = ""):
        if isinstance(problems, str):
            problems = [(path, problems)]
        self.problems = list(problems)
        super().__init__("\n".join(f"{p}: {m}" if p else m for p, m in self.problems))


def suggest(key: str, candidates: Iterable[str]) -> str | None:
    """The closest valid key to a misspelled one, or None when nothing is close."""
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(key: str, candidates: Iterable[str]) -> str:
    best = suggest(key, candidates)
    return f"unknown key; did you mean {best}?" if best else "unknown key"
