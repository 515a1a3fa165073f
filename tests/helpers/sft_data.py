"""Instruction data for the SFT tests: rows in each format, a tokenizer trained on their words, and
reading the trained tokens of a built row back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.args import DataArguments
from trainer.data import IGNORE_INDEX, train_bpe_tokenizer

SYSTEM = "You write Python."
# (user, assistant) exchanges; the last answer spells the EOS token as text.
TURNS = [
    ("Square x.", "x ** 2"),
    ("And the cube?", "x ** 3"),
    ("Print the end marker.", "print('<|eos|>')"),
]


def sharegpt_row(turns: list[tuple[str, str]] = TURNS, system: str | None = SYSTEM) -> dict[str, Any]:
    head = [{"from": "system", "value": system}] if system else []
    return {
        "conversations": head
        + [m for u, a in turns for m in ({"from": "human", "value": u}, {"from": "gpt", "value": a})]
    }


def messages_of(turns: list[tuple[str, str]] = TURNS, system: str | None = SYSTEM) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [
        m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})
    ]


def corpus() -> list[str]:
    words = [SYSTEM, *(t for pair in TURNS for t in pair), "Reverse a string s.", "s[::-1]"]
    markers = ["<|system|>\n", "<|user|>\n", "<|assistant|>\n"]
    return (words + markers) * 20


def tokenizer():
    return train_bpe_tokenizer(corpus(), vocab_size=400)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(tmp_path: Path, rows: list[dict[str, Any]], name: str = "sft.jsonl", **kw: Any) -> DataArguments:
    """Data arguments for ``rows`` written as JSONL: one unpacked row per example, nothing held out."""
    kw.setdefault("data_format", "sft")
    kw.setdefault("validation_split_percentage", 0)
    kw.setdefault("packing", False)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / name, rows)
    return DataArguments(dataset=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def trained_runs(row: dict[str, list[int]]) -> list[list[int]]:
    """The token ids of each run of consecutive trained positions; a label is its input id or -100."""
    runs: list[list[int]] = []
    current: list[int] = []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        assert label in (token, IGNORE_INDEX)
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(token)
    return [*runs, current] if current else runs


def plain(tok: Any, text: str) -> list[int]:
    """``text`` as the tokenizer reads a message's content: no added tokens, specials as text."""
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
