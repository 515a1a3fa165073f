"""Supervised fine-tuning sets as TRL's ``SFTTrainer`` prepares them, so a row gives the same tokens,
the same trained positions and the same packed rows in both.

Formats (TRL's), each with text or with conversations (lists of ``{"role", "content"}`` messages):
- language modelling: ``text`` (``dataset_text_field``) or ``messages``;
- prompt-completion: ``prompt`` and ``completion``;
- ShareGPT's ``conversations`` of ``{"from", "value"}`` messages, read as ``messages``.

The steps, in TRL's order: a ``formatting_func`` turns each row into ``text``; a text (or text
completion) ends with the EOS token, added when missing; text is tokenised with the tokenizer's
special tokens and a conversation through its chat template (with the row's ``tools`` and
``chat_template_kwargs``). A prompt's completion starts where the ids of the prompt alone (with the
generation prompt) and of prompt and completion first differ. ``labels`` are the ids, -100 outside
the completion (``completion_only_loss``) and outside the assistant turns the template marks with
``{% generation %}`` (``assistant_only_loss``); a set that has ``input_ids`` already is not
tokenised again, and one with ``labels`` keeps them. Unpacked, a row is cut to ``max_length`` and
dropped when no target is left. Packed, rows are joined into rows of ``max_length`` tokens:
- ``bfd``: best-fit decreasing, longest first, each into the open row it fills most tightly; a
  longer one is cut (``bfd_split``: split into pieces). ``position_ids`` restart at every sequence,
  and a sequence's first token is no target, so sequences neither see nor predict each other. TRL
  flattens such a batch into one row; here its rows stay apart, padded, with the same attention and
  the same targets.
- ``wrapped``: one stream of tokens, cut every ``max_length`` (sequences see each other).
Packing works in TRL's chunks of 1,000 rows (per ``datasets.map`` batch).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict, deque
from collections.abc import Callable
from itertools import chain
from typing import Any

import pyarrow as pa

from trainer.data.chat import IGNORE_INDEX
from trainer.data.preference import is_conversation

MASKS = ("completion_mask", "assistant_masks")


def is_conversational(row: dict[str, Any]) -> bool:
    """TRL's test: the row's messages, prompt or completion is a list of messages."""
    return any(is_conversation(row.get(key)) for key in ("messages", "prompt", "completion"))


def _from_value(row: dict[str, Any]) -> dict[str, Any]:
    """ShareGPT's ``conversations`` of ``from``/``value`` messages as ``messages`` of ``role``/``content``."""
    rename = {"from": "role", "value": "content"}
    return {"messages": [{rename.get(k, k): v for k, v in m.items()} for m in row["conversations"]]}


def _with_eos(row: dict[str, Any], eos: str, text_field: str) -> dict[str, Any]:
    for key in (text_field, "completion"):
        if isinstance(row.get(key), str):
            return {key: row[key] if row[key].endswith(eos) else row[key] + eos}
    return {}


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def tokenize_row(
    row: dict[str, Any], tokenizer: Any, text_field: str, assistant_only: bool
) -> dict[str, list[int]]:
    """``input_ids`` of one row, with its ``completion_mask`` (prompt-completion rows) and
    ``assistant_masks`` (conversations, under ``assistant_only``)."""
    tools = row.get("tools")
    options = {
        "tools": json.loads(tools) if isinstance(tools, str) else tools,
        **(row.get("chat_template_kwargs") or {}),
    }

    def chat(messages: list, **extra: Any) -> dict[str, list[int]]:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options, **extra)

    masks = {"return_assistant_tokens_mask": True} if assistant_only else {}
    if "prompt" in row:
        if is_conversational(row):
            prompt = chat(row["prompt"], add_generation_prompt=True)["input_ids"]
            full = chat(row["prompt"] + row["completion"], **masks)
        else:
            prompt = tokenizer(text=row["prompt"])["input_ids"]
            full = tokenizer(text=row["prompt"] + row["completion"])
        ids = list(full["input_ids"])
        start = common_prefix_length(prompt, ids)
        out = {"input_ids": ids, "completion_mask": [0] * start + [1] * (len(ids) - start)}
    elif is_conversational(row):
        full = chat(row["messages"], **masks)
        out = {"input_ids": list(full["input_ids"])}
    else:
        return {"input_ids": list(tokenizer(text=row[text_field])["input_ids"])}
    if assistant_only:
        out["assistant_masks"] = list(full["assistant_masks"])
    return out


def _labels(row: dict[str, Any], masks: list[str]) -> dict[str, list[int]]:
    """The ids, -100 where any of ``masks`` is 0."""
    ids = row["input_ids"]
    if not masks:
        return {"labels": list(ids)}
    keep = zip(*(row[m] for m in masks), strict=True)
    return {"labels": [t if all(bits) else IGNORE_INDEX for t, bits in zip(ids, keep, strict=True)]}


# ---- packing ------------------------------------------------------------------------------------


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` (each at most ``capacity``) grouped into bins: longest first (equal
    lengths in their order), each into the open bin with the least free space that fits it (the
    earliest opened among equals), else into a new bin."""
    free: list[int] = []  # the open bins' free spaces, sorted, one entry per bin
    bins_with: dict[int, deque[list[int]]] = defaultdict(deque)
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, lengths[i])
        if at < len(free):
            space = free.pop(at)
            members = bins_with[space].popleft()
        else:
            space, members = capacity, []
            bins.append(members)
        members.append(i)
        space -= lengths[i]
        if space > 0:
            bisect.insort(free, space)
            bins_with[space].append(members)
    return bins


def _pieces(ids: list[int], labels: list[int], length: int, split: bool) -> list[tuple[list[int], list[int]]]:
    if not split:
        return [(ids[:length], labels[:length])]
    return [(ids[i : i + length], labels[i : i + length]) for i in range(0, len(ids), length)]


def pack_table(table: pa.Table, length: int, strategy: str) -> pa.Table:
    """One chunk of rows (``input_ids``, ``labels``) packed into rows of at most ``length`` tokens."""
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    if strategy == "wrapped":
        flat_ids, flat_labels = list(chain.from_iterable(ids)), list(chain.from_iterable(labels))
        starts = range(0, len(flat_ids), length)
        return pa.table({
            "input_ids": [flat_ids[s : s + length] for s in starts],
            "labels": [flat_labels[s : s + length] for s in starts],
        })  # fmt: skip
    split = strategy == "bfd_split"
    seqs = [p for i, t in zip(ids, labels, strict=True) if i for p in _pieces(i, t, length, split)]
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in best_fit_decreasing([len(s[0]) for s in seqs], length):
        rows["input_ids"].append([t for m in members for t in seqs[m][0]])
        # A sequence's first token is predicted by nothing of its own: no target
        rows["labels"].append([t for m in members for t in [IGNORE_INDEX, *seqs[m][1][1:]]])
        rows["position_ids"].append([p for m in members for p in range(len(seqs[m][0]))])
    return pa.table(rows)


# ---- the whole preparation ----------------------------------------------------------------------


def prepare_sft(
    dataset: Any,
    tokenizer: Any,
    args: Any,
    name: str,
    packing: bool,
    completion_only: bool,
    formatting_func: Callable[[dict[str, Any]], str] | None = None,
) -> Any:
    """A ``datasets.Dataset`` of SFT rows (any format above) as ``input_ids``, ``labels`` and, packed
    best-fit, ``position_ids``; ``args``: an ``SFTConfig``. A row that cannot be read is one
    ValueError naming the set and the row."""
    if dataset.format["type"] == "custom":
        raise ValueError(
            f"the {name} set has a with_transform() transform, which preparing it would bake into its "
            "tokens; apply it with map() first, or pass dataset_kwargs={'skip_prepare_dataset': True}"
        )
    num_proc = args.dataset_num_proc
    processed = "input_ids" in dataset.column_names
    if not processed:
        if formatting_func is not None:
            dataset = dataset.map(lambda row: {"text": formatting_func(row)}, num_proc=num_proc)
        if "conversations" in dataset.column_names:
            dataset = dataset.map(_from_value, remove_columns=["conversations"], num_proc=num_proc)
        dataset = _tokenized(dataset, tokenizer, args, name)
    columns = dataset.column_names
    if "labels" not in columns:
        masks = [m for m in MASKS if m in columns and (completion_only or m != "completion_mask")]
        dropped = [m for m in MASKS if m in columns]
        dataset = dataset.map(_labels, fn_kwargs={"masks": masks}, remove_columns=dropped, num_proc=num_proc)
    if packing:
        dataset = dataset.select_columns(["input_ids", "labels"])
        if args.shuffle_dataset:
            dataset = dataset.shuffle(seed=args.seed)
        dataset = (
            dataset.with_format("arrow")
            .map(
                pack_table,
                batched=True,
                fn_kwargs={"length": args.max_length, "strategy": args.packing_strategy},
                num_proc=num_proc,
                desc=f"Packing the {name} set",
            )
            .with_format(None)
        )
    elif args.max_length is not None:
        cut = (
            slice(None, args.max_length)
            if args.truncation_mode == "keep_start"
            else slice(-args.max_length, None)
        )
        dataset = dataset.map(
            lambda row: {"input_ids": row["input_ids"][cut], "labels": row["labels"][cut]}, num_proc=num_proc
        )
        dataset = dataset.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"]), num_proc=num_proc)
    return dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset


def _tokenized(dataset: Any, tokenizer: Any, args: Any, name: str) -> Any:
    first = dataset[0]
    conversational = is_conversational(first)
    if args.assistant_only_loss and not conversational:
        raise ValueError(
            f"assistant_only_loss: the {name} set is not conversational (no messages, or prompt and "
            "completion as messages); it is read for conversations only"
        )
    if not (
        ("prompt" in first and "completion" in first)
        or "messages" in first
        or args.dataset_text_field in first
    ):
        raise ValueError(
            f"the {name} set has no {args.dataset_text_field} column (dataset_text_field), messages, or "
            f"prompt and completion (columns: {', '.join(dataset.column_names)})"
        )
    if not conversational:
        dataset = dataset.map(
            _with_eos, fn_kwargs={"eos": tokenizer.eos_token, "text_field": args.dataset_text_field},
            num_proc=args.dataset_num_proc,
        )  # fmt: skip

    def one(row: dict[str, Any], index: int) -> dict[str, list[int]]:
        out = tokenize_row(row, tokenizer, args.dataset_text_field, args.assistant_only_loss)
        if args.assistant_only_loss and 1 not in out["assistant_masks"]:
            raise ValueError(
                f"the {name} set's row {index}: assistant_only_loss is set but the chat template marks no "
                "assistant token of it ({% generation %} ... {% endgeneration %} around the assistant turns)"
            )
        return out

    return dataset.map(
        one, with_indices=True, remove_columns=dataset.column_names, num_proc=args.dataset_num_proc,
        desc=f"Tokenizing the {name} set",
    )  # fmt: skip


def has_generation_marks(template: str | dict[str, str] | None) -> bool:
    """Whether a chat template (of named ones, the ``default``) marks the assistant's tokens with
    ``{% generation %}``, as ``return_assistant_tokens_mask`` needs."""
    if isinstance(template, dict):
        template = template.get("default")
    return bool(template) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None
