"""``build_datasets``: raw source -> tokenised, split, packed train/eval datasets, cached on disk.

Cache layout under the cache root (``data_args.cache_dir`` or ``~/.cache/trainer/datasets``)::

    <format>-<key>/tokens.arrow        output of the tokenising ``datasets.map`` (its cache file)
    <format>-<key>/final/train.arrow   packed (or per-document) training rows
    <format>-<key>/final/eval.arrow    the same for the held-out documents, when there are any
    <format>-<key>/final/info.json     what was built and its sizes; written last

``key`` hashes the source fingerprint, the tokenizer, the format, the text column, block size,
packing, the validation percentage and the seed. ``final/`` appears by an atomic rename, so a run
that finds ``final/info.json`` uses it as is; that is a cache hit and nothing is tokenised. A file
lock (``<format>-<key>.lock``) lets one process build while the other ranks of a node wait for it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
from datasets.arrow_writer import ArrowWriter
from filelock import FileLock

from trainer.args import DataArguments
from trainer.data.processing import (
    PACKED_FEATURES,
    SFT_FEATURES,
    TEXT_FEATURES,
    pack_documents,
    split_indices,
    tokenise_sft_batch,
    tokenise_text_batch,
    unpacked_rows,
)
from trainer.data.sources import (
    DataError,
    RawData,
    cache_root,
    load_raw,
    require_columns,
    resolve_source,
    sft_columns,
    stable_hash,
)
from trainer.data.tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)

# Bump when the on-disk format or the processing changes, so stale caches are not reused.
CACHE_VERSION = 1


@dataclass
class PreparedData:
    """What :func:`prepare_datasets` built, and whether it came from the cache."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    cache_hit: bool
    cache_dir: Path
    info: dict[str, Any] = field(default_factory=dict)


def build_datasets(
    data_args: DataArguments, tokenizer: Any, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, eval) datasets of ``input_ids`` (+ ``position_ids`` when packed, ``labels`` for SFT)."""
    prepared = prepare_datasets(data_args, tokenizer, seed)
    return prepared.train, prepared.eval


def _packs(data_args: DataArguments) -> bool:
    # SFT rows are never packed: each row is one prompt/response with its own loss mask.
    return data_args.packing and data_args.data_format == "text"


def cache_key(data_args: DataArguments, source_fingerprint: str, tokenizer: Any, seed: int) -> str:
    return stable_hash(
        {
            "v": CACHE_VERSION,
            "data": source_fingerprint,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "format": data_args.data_format,
            "column": data_args.text_column,
            "block_size": data_args.block_size,
            "packing": _packs(data_args),
            "validation": data_args.validation_split_percentage,
            "seed": seed,
        }
    )


def prepare_datasets(data_args: DataArguments, tokenizer: Any, seed: int) -> PreparedData:
    """Like :func:`build_datasets`, also reporting the cache directory and whether it was hit."""
    if tokenizer.eos_token_id is None:
        raise DataError([("tokenizer_name_or_path", "the tokenizer has no EOS token; documents need one")])
    source = resolve_source(data_args)
    raw = load_raw(data_args, source) if source.kind == "hub" else None  # a hub fingerprint needs the data
    key = cache_key(data_args, source.fingerprint, tokenizer, seed)
    base = cache_root(data_args) / f"{data_args.data_format}-{key[:20]}"
    final = base / "final"
    base.parent.mkdir(parents=True, exist_ok=True)
    # One process builds while the others (ranks of this node) wait, then find the cache warm.
    with FileLock(str(base) + ".lock"):
        cached = _open_cache(final)
        hit = cached is not None
        if hit:
            logger.info("tokenised dataset cache hit: %s", final)
        else:
            _build(data_args, tokenizer, seed, raw or load_raw(data_args, source), base)
            cached = _read_splits(final)
    info, train, eval_ds = cached
    if data_args.max_train_samples is not None and data_args.max_train_samples < len(train):
        train = train.select(range(data_args.max_train_samples))
    return PreparedData(train, eval_ds, hit, final, info)


def _open_cache(final: Path) -> tuple[dict[str, Any], datasets.Dataset, datasets.Dataset | None] | None:
    """The cached splits; None on a miss, or when the cache is damaged (a truncated or unreadable
    file, fewer rows than ``info.json`` records): then it is removed with one warning and rebuilt."""
    if not (final / "info.json").exists():
        return None
    try:
        return _read_splits(final)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as err:
        logger.warning(
            "tokenised dataset cache %s is damaged (%s); removing it and tokenising again", final, err
        )
        shutil.rmtree(final.parent, ignore_errors=True)  # tokens.arrow too: it may be damaged as well
        return None


def _read_splits(final: Path) -> tuple[dict[str, Any], datasets.Dataset, datasets.Dataset | None]:
    """info.json and the memory-mapped splits, each checked against the row count info.json records
    (an Arrow stream cut at a batch boundary reads without error, only shorter)."""
    info = json.loads((final / "info.json").read_text())
    splits = []
    for name in ("train", "eval"):
        if name == "eval" and not info["eval"]:
            splits.append(None)
            continue
        split = datasets.Dataset.from_file(str(final / f"{name}.arrow"))
        if len(split) != info[name]["samples"]:
            raise ValueError(
                f"{name}.arrow holds {len(split)} rows, info.json records {info[name]['samples']}"
            )
        splits.append(split)
    return info, splits[0], splits[1]


def _tokenise(
    ds: datasets.Dataset, data_args: DataArguments, tokenizer: Any, cache_file: Path
) -> datasets.Dataset:
    """One cached, batched, optionally multi-process ``datasets.map`` over the raw rows."""
    if data_args.data_format == "sft":
        columns = sft_columns(ds, data_args.dataset)
        fn, features = tokenise_sft_batch, SFT_FEATURES
        kwargs = {"tokenizer": tokenizer, "max_length": data_args.block_size}
    else:
        columns = [data_args.text_column]
        require_columns(ds, "text_column", columns, data_args.dataset)
        fn, features = tokenise_text_batch, TEXT_FEATURES
        max_length = None if _packs(data_args) else data_args.block_size
        kwargs = {"tokenizer": tokenizer, "column": data_args.text_column, "max_length": max_length}
    num_proc = data_args.preprocessing_num_workers
    if num_proc and num_proc > 1:
        # Each worker tokenises its own shard; the tokenizer's own thread pool would oversubscribe.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ds.select_columns(columns).map(
        fn,
        batched=True,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=columns,
        fn_kwargs=kwargs,
        features=features,
        cache_file_name=str(cache_file),
        new_fingerprint=cache_file.parent.name + cache_file.stem,
        desc="Tokenising",
    )


def _build(data_args: DataArguments, tokenizer: Any, seed: int, raw: RawData, base: Path) -> None:
    name = data_args.dataset
    if len(raw.train) == 0:
        raise DataError([("dataset", f"{name}: the dataset is empty")])
    base.mkdir(parents=True, exist_ok=True)
    docs = _tokenise(raw.train, data_args, tokenizer, base / "tokens.arrow")
    sft = data_args.data_format == "sft"
    if len(docs) == 0:
        what = "rows with a response that fits block_size" if sft else "non-empty documents"
        raise DataError([("dataset", f"{name}: no {what}")])
    if len(docs) < len(raw.train):
        why = "no response token within block_size" if sft else "empty text"
        logger.info("%s: skipped %d of %d rows (%s)", name, len(raw.train) - len(docs), len(raw.train), why)
    if raw.eval is not None:
        train_docs, eval_docs = docs, _tokenise(raw.eval, data_args, tokenizer, base / "eval-tokens.arrow")
    else:
        train_idx, eval_idx = split_indices(len(docs), data_args.validation_split_percentage, seed)
        train_docs = docs.select(train_idx)
        eval_docs = docs.select(eval_idx) if eval_idx else None

    tmp = Path(tempfile.mkdtemp(prefix=".final.", dir=base))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        info: dict[str, Any] = {
            "dataset": name,
            "format": data_args.data_format,
            "block_size": data_args.block_size,
            "packing": _packs(data_args),
            "seed": seed,
        }
        info["train"] = _write_split(train_docs, data_args, tmp / "train.arrow")
        info["eval"] = (
            _write_split(eval_docs, data_args, tmp / "eval.arrow") if eval_docs is not None else None
        )
        (tmp / "info.json").write_text(json.dumps(info, indent=2))
        try:
            os.rename(tmp, base / "final")
        except OSError:  # another rank finished first with the same result
            if not (base / "final" / "info.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tokenised %s: %s; cached at %s", name, info["train"], base / "final")


def _write_split(docs: datasets.Dataset, data_args: DataArguments, path: Path) -> dict[str, int]:
    if _packs(data_args):
        tables, features = pack_documents(docs, data_args.block_size), PACKED_FEATURES
    elif data_args.data_format == "sft":
        tables, features = unpacked_rows(docs, ["input_ids", "labels"]), SFT_FEATURES
    else:
        tables, features = unpacked_rows(docs, ["input_ids"]), TEXT_FEATURES
    samples, tokens = _write_tables(tables, features, path)
    return {"documents": len(docs), "samples": samples, "tokens": tokens}


def _write_tables(tables: Iterable[pa.Table], features: datasets.Features, path: Path) -> tuple[int, int]:
    writer = ArrowWriter(path=str(path), features=features)
    samples = tokens = 0
    try:
        for table in tables:
            writer.write_table(table.cast(features.arrow_schema))
            samples += table.num_rows
            tokens += pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0
        writer.finalize()
    finally:
        writer.close()
    return samples, tokens
