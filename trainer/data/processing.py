"""Turning documents into training rows: tokenisation (text and SFT), packing, splitting.

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

from trainer.data.sources import DataError

IGNORE_INDEX = -100

TOKENS = datasets.List(datasets.Value("int32"))
TEXT_FEATURES = datasets.Features({"input_ids": TOKENS})
SFT_FEATURES = datasets.Features({"input_ids": TOKENS, "labels": TOKENS})
PACKED_FEATURES = datasets.Features({"input_ids": TOKENS, "position_ids": TOKENS})


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


def render_messages(messages: list[dict[str, str]], tokenizer: Any) -> tuple[str, str]:
    """A chat as (prompt, response) strings; the response is the final assistant message.

    With a tokenizer chat template, the prompt is the template applied to every message but the
    last with the generation prompt, and the response is what the full rendering adds to it.
    Without one, a plain template is used::

        <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{response}
    """
    if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        raise DataError(
            [("data_format", "sft: the last message of every 'messages' row must be the assistant's")]
        )
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise DataError(
                [("data_format", "sft: the chat template does not render the prompt as a prefix")]
            )
        return prompt, full[len(prompt) :]
    prompt = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages[:-1])
    return prompt + "<|assistant|>\n", messages[-1]["content"] or ""


def tokenise_sft_batch(
    batch: dict[str, list[Any]], tokenizer: Any, max_length: int
) -> dict[str, list[list[int]]]:
    """Rows -> ``input_ids`` = prompt + response + EOS, ``labels`` = -100 on the prompt.

    ``prompt``/``response`` rows are used verbatim (the user owns their formatting); ``messages``
    rows go through :func:`render_messages`. Prompt and response are tokenised separately so the
    loss boundary is exact. Rows longer than ``max_length`` are truncated from the right; a row
    with no response token left is dropped.
    """
    if "messages" in batch:
        pairs = [render_messages(m, tokenizer) for m in batch["messages"]]
    else:
        pairs = [(p or "", r or "") for p, r in zip(batch["prompt"], batch["response"], strict=True)]
    if not pairs:
        return {"input_ids": [], "labels": []}
    templated = bool(getattr(tokenizer, "chat_template", None)) and "messages" in batch
    # A chat template writes control tokens as text; they must be parsed as special tokens.
    split = not templated
    eos = tokenizer.eos_token_id
    prompts = tokenizer(
        [p for p, _ in pairs], add_special_tokens=True, split_special_tokens=split, verbose=False
    )
    responses = tokenizer(
        [r for _, r in pairs], add_special_tokens=False, split_special_tokens=split, verbose=False
    )
    input_ids, labels = [], []
    for p, r in zip(prompts["input_ids"], responses["input_ids"], strict=True):
        if p and p[-1] == eos:  # some tokenizers append EOS to every encoding
            p = p[:-1]
        if not r or r[-1] != eos:
            r = [*r, eos]
        ids = (p + r)[:max_length]
        lab = ([IGNORE_INDEX] * len(p) + r)[:max_length]
        if any(x != IGNORE_INDEX for x in lab):
            input_ids.append(ids)
            labels.append(lab)
    return {"input_ids": input_ids, "labels": labels}


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


def unpacked_rows(
    docs: datasets.Dataset, columns: list[str], rows_per_chunk: int = 1000
) -> Iterator[pa.Table]:
    """The rows of ``docs`` unchanged (one sample per document), as Arrow tables."""
    for table in docs.with_format("arrow").iter(batch_size=rows_per_chunk):
        yield table.select(columns)
