"""Turning documents into training rows: tokenisation (text and instruction rows), packing, splitting.

These are pure functions over batches and Arrow tables; ``build.py`` wires them to `datasets.map`
and the on-disk cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer.data.chat import (
    IGNORE_INDEX,
    Segment,
    chat_segments,
    encode_segments,
    leading_ids,
    pair_segments,
)
from trainer.data.formats import Chat, RowProblem, parse_row

TOKENS = datasets.List(datasets.Value("int32"))
TEXT_FEATURES = datasets.Features({"input_ids": TOKENS})
SFT_FEATURES = datasets.Features({"input_ids": TOKENS, "labels": TOKENS})
# What tokenising instruction rows writes; `row` and `problem` go once the problems are checked.
SFT_ROW_FEATURES = datasets.Features(
    {
        "input_ids": TOKENS,
        "labels": TOKENS,
        "row": datasets.Value("int64"),
        "problem": datasets.Value("string"),
    }
)
PACKED_FEATURES = datasets.Features({"input_ids": TOKENS, "position_ids": TOKENS})
SFT_PACKED_FEATURES = datasets.Features({"input_ids": TOKENS, "labels": TOKENS, "position_ids": TOKENS})


def tokenise_text_batch(
    batch: dict[str, list[Any]], tokenizer: Any, column: str, max_length: int | None
) -> dict[str, list[list[int]]]:
    """Each non-empty document -> its tokens followed by one EOS (truncated to ``max_length``).

    Empty or missing texts are dropped. Special-token strings that occur literally in the text
    (``<|eos|>`` inside a source file) are tokenised as plain text, never as control tokens.
    """
    texts = [t for t in batch[column] if isinstance(t, str) and t]
    if not texts:
        return {"input_ids": []}
    eos = tokenizer.eos_token_id
    encoded = tokenizer(texts, add_special_tokens=True, split_special_tokens=True, verbose=False)["input_ids"]
    rows = []
    for ids in encoded:
        if not ids or ids[-1] != eos:
            ids = [*ids, eos]
        rows.append(ids[:max_length] if max_length else ids)
    return {"input_ids": rows}


def _row_segments(fmt: str, row: dict[str, Any], tokenizer: Any, lead: tuple[int, ...]) -> list[Segment]:
    example = parse_row(fmt, row)
    if isinstance(example, Chat):
        return chat_segments(example, tokenizer)
    return pair_segments(example, lead, tokenizer.eos_token_id)


def _trim(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """A row's first token is no target: nothing precedes it (packed, the row before would). The
    tokens after the last target carry no loss and nothing attends to them, so the row ends there."""
    labels = [IGNORE_INDEX, *labels[1:]] if labels else labels
    end = next((i + 1 for i in range(len(labels) - 1, -1, -1) if labels[i] != IGNORE_INDEX), 0)
    return ids[:end], labels[:end]


def _fit(
    ids: list[int], labels: list[int], block_size: int, long_rows: str
) -> tuple[list[int], list[int], str] | None:
    """A row against ``block_size`` under the ``long_rows`` policy: the row (cut when truncating),
    or None to drop it; a problem when it is an error."""
    if len(ids) <= block_size:
        return ids, labels, ""
    if long_rows == "error":
        return [], [], f"{len(ids)} tokens, longer than block_size {block_size}"
    if long_rows == "drop" or all(x == IGNORE_INDEX for x in labels[:block_size]):
        return None
    return ids[:block_size], labels[:block_size], ""


def tokenise_rows_batch(
    batch: dict[str, list[Any]],
    indices: list[int],
    tokenizer: Any,
    fmt: str,
    block_size: int,
    long_rows: str,
) -> dict[str, list[Any]]:
    """Instruction rows -> ``input_ids`` and ``labels`` (-100 on everything but the trained tokens).

    Every output row carries its source ``row`` index and a ``problem`` (empty when fine); a row
    with a problem has no tokens, and the builder reports it. Rows longer than ``block_size``
    follow ``long_rows``: a problem ("error"), left out ("drop"), or cut from the right
    ("truncate", left out when no trained token is left).
    """
    lead = leading_ids(tokenizer)
    segments, problems = [], []
    for i in range(len(indices)):
        try:
            segments.append(_row_segments(fmt, {c: batch[c][i] for c in batch}, tokenizer, lead))
            problems.append("")
        except RowProblem as err:
            segments.append([])
            problems.append(str(err))
    out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "row": [], "problem": []}
    encoded = encode_segments(segments, tokenizer)
    for index, (ids, labels), problem in zip(indices, encoded, problems, strict=True):
        ids, labels = _trim(ids, labels)
        if not (ids or problem):
            problem = "no token to train on (an empty answer that opens the row)"
        if problem:
            ids, labels = [], []
        else:
            fitted = _fit(ids, labels, block_size, long_rows)
            if fitted is None:
                continue
            ids, labels, problem = fitted
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["row"].append(index)
        out["problem"].append(problem)
    return out


def split_indices(n: int, percentage: float, seed: int) -> tuple[list[int], list[int] | None]:
    """Hold out ``percentage`` % of ``n`` documents (at least one), chosen from ``seed``.

    Both index lists are sorted, so documents keep their corpus order. With fewer than two
    documents or a zero percentage there is no eval split.
    """
    if percentage <= 0 or n < 2:
        return list(range(n)), None
    n_eval = min(max(1, round(n * percentage / 100)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return sorted(perm[n_eval:].tolist()), sorted(perm[:n_eval].tolist())


def _doc_positions(col: pa.ChunkedArray | pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened tokens of a list column and each token's position inside its document."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int32)
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return flat, (np.arange(len(flat)) - starts).astype(np.int32)


def _blocks(ids: np.ndarray, doc_pos: np.ndarray, block_size: int) -> pa.Table:
    # A block starts a new sequence, so a document cut by a block boundary restarts at 0 there.
    positions = np.minimum(doc_pos, np.arange(len(ids)) % block_size).astype(np.int32)
    offsets = pa.array(np.append(np.arange(0, len(ids), block_size), len(ids)), pa.int32())
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
            "position_ids": pa.ListArray.from_arrays(offsets, pa.array(positions)),
        }
    )


def pack_documents(docs: datasets.Dataset, block_size: int, docs_per_chunk: int = 1000) -> Iterator[pa.Table]:
    """Concatenate tokenised documents (each already ending in EOS) and cut into blocks.

    Every token is kept: all blocks hold ``block_size`` tokens except the last, which holds the
    rest. ``position_ids`` count from 0 at each document start and at each block start. Works in
    chunks of documents, so memory stays bounded by the chunk, not the corpus.
    """
    carry_ids = np.empty(0, np.int32)
    carry_pos = np.empty(0, np.int32)
    for table in docs.with_format("arrow").iter(batch_size=docs_per_chunk):
        flat, pos = _doc_positions(table.column("input_ids"))
        ids = np.concatenate([carry_ids, flat])
        doc_pos = np.concatenate([carry_pos, pos])
        full = len(ids) // block_size * block_size
        if full:
            yield _blocks(ids[:full], doc_pos[:full], block_size)
        carry_ids, carry_pos = ids[full:], doc_pos[full:]
    if len(carry_ids):
        yield _blocks(carry_ids, carry_pos, block_size)


def _block_starts(lengths: np.ndarray, block_size: int) -> list[int]:
    """Row indices where a block begins: a block takes the next row while the row still fits."""
    starts, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if used and used + n > block_size:
            starts.append(i)
            used = 0
        used += n
    return starts


def _row_blocks(table: pa.Table, starts: list[int]) -> pa.Table:
    """The rows of ``table`` joined into blocks that begin at the row indices ``starts``."""
    ids, positions = _doc_positions(table.column("input_ids"))
    labels, _ = _doc_positions(table.column("labels"))
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
    row_offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = pa.array(np.append(row_offsets[starts], len(ids)), pa.int32())
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(labels)),
            "position_ids": pa.ListArray.from_arrays(offsets, pa.array(positions)),
        }
    )


def pack_rows(docs: datasets.Dataset, block_size: int, rows_per_chunk: int = 1000) -> Iterator[pa.Table]:
    """Whole instruction rows, in order, into blocks of at most ``block_size`` tokens.

    A block takes rows while the next one fits, so no row is split and a block is rarely full
    (the collator pads it). ``position_ids`` restart at 0 at every row, which keeps the rows of a
    block from attending to each other (see docs/data.md). Every row must fit a block.
    """
    carry: pa.Table | None = None
    for table in docs.with_format("arrow").iter(batch_size=rows_per_chunk):
        table = table.select(["input_ids", "labels"])
        if carry is not None:
            table = pa.concat_tables([carry, table])
        lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False)
        starts = _block_starts(lengths, block_size)
        if starts[-1]:  # the last block may take rows of the next chunk
            yield _row_blocks(table.slice(0, starts[-1]), starts[:-1])
        carry = table.slice(starts[-1])
    if carry is not None and carry.num_rows:
        yield _row_blocks(carry, [0])


def unpacked_rows(
    docs: datasets.Dataset, columns: list[str], rows_per_chunk: int = 1000
) -> Iterator[pa.Table]:
    """The rows of ``docs`` unchanged (one sample per document), as Arrow tables."""
    for table in docs.with_format("arrow").iter(batch_size=rows_per_chunk):
        yield table.select(columns)
