"""``build_datasets``: raw source -> tokenised, split, packed train/eval datasets, cached on disk.

Cache layout under the cache root (``data_args.cache_dir`` or ``~/.cache/trainer/datasets``)::

    <format>-<key>/tokens.arrow        output of the tokenising ``datasets.map`` (its cache file)
    <format>-<key>/eval-tokens.arrow   the same for a validation file (or the source's eval split)
    <format>-<key>/final/train.arrow   packed (or one row per document) training rows
    <format>-<key>/final/eval.arrow    the same for the held-out documents, when there are any
    <format>-<key>/final/info.json     what was built and its sizes; written last

``key`` hashes the source fingerprint (and the validation file's), the tokenizer, the format, the
text column, block size, packing, the long-row policy, the validation percentage and the seed. ``final/`` appears by an atomic rename, so a run
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
from trainer.data.formats import FORMAT_COLUMNS, format_columns, resolve_format
from trainer.data.processing import (
    PACKED_FEATURES,
    SFT_FEATURES,
    SFT_PACKED_FEATURES,
    SFT_ROW_FEATURES,
    TEXT_FEATURES,
    pack_documents,
    pack_rows,
    split_indices,
    tokenise_rows_batch,
    tokenise_text_batch,
    unpacked_rows,
)
from trainer.data.sources import (
    DataError,
    RawData,
    Source,
    cache_root,
    load_raw,
    load_validation,
    require_columns,
    resolve_source,
    stable_hash,
)
from trainer.data.tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)

# Bump when the on-disk format or the processing changes, so stale caches are not reused.
CACHE_VERSION = 2
# Rows with a problem listed by index in the error; the rest are counted.
MAX_LISTED_ROWS = 10
# Why instruction rows were left out, by long_rows policy ("error" leaves none out).
LEFT_OUT = {"drop": "longer than block_size", "truncate": "no trained token within block_size", "error": ""}


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


def cache_key(
    data_args: DataArguments,
    source_fingerprint: str,
    tokenizer: Any,
    seed: int,
    validation: str | None = None,
) -> str:
    return stable_hash(
        {
            "v": CACHE_VERSION,
            "data": source_fingerprint,
            "validation_file": validation,
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "format": data_args.data_format,
            "column": data_args.text_column,
            "block_size": data_args.block_size,
            "packing": data_args.packing,
            "long_rows": data_args.long_rows,
            "validation": data_args.validation_split_percentage,
            "seed": seed,
        }
    )


def prepare_datasets(data_args: DataArguments, tokenizer: Any, seed: int) -> PreparedData:
    """Like :func:`build_datasets`, also reporting the cache directory and whether it was hit."""
    if tokenizer.eos_token_id is None:
        raise DataError([("tokenizer_name_or_path", "the tokenizer has no EOS token; documents need one")])
    source = resolve_source(data_args)
    held_out = None
    if data_args.validation_file is not None:
        held_out = resolve_source(data_args, data_args.validation_file, "validation_file")
    raw = load_raw(data_args, source) if source.kind == "hub" else None  # a hub fingerprint needs the data
    key = cache_key(data_args, source.fingerprint, tokenizer, seed, held_out and held_out.fingerprint)
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
            _build(data_args, tokenizer, seed, raw or load_raw(data_args, source), held_out, base)
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


def _map(
    ds: datasets.Dataset,
    columns: list[str],
    fn: Any,
    features: datasets.Features,
    kwargs: dict[str, Any],
    num_proc: int | None,
    cache_file: Path,
    with_indices: bool = False,
) -> datasets.Dataset:
    """One cached, batched, optionally multi-process ``datasets.map`` over the raw rows."""
    if num_proc and num_proc > 1:
        # Each worker tokenises its own shard; the tokenizer's own thread pool would oversubscribe.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ds.select_columns(columns).map(
        fn,
        batched=True,
        with_indices=with_indices,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=columns,
        fn_kwargs=kwargs,
        features=features,
        cache_file_name=str(cache_file),
        new_fingerprint=cache_file.parent.name + cache_file.stem,
        desc="Tokenising",
    )


def _tokenise(
    ds: datasets.Dataset, fmt: str, data_args: DataArguments, tokenizer: Any, cache_file: Path, key: str
) -> datasets.Dataset:
    """The rows of ``ds`` tokenised; instruction rows with a problem are one DataError naming them
    (under ``key``, the argument that named the data)."""
    workers = data_args.preprocessing_num_workers
    if fmt == "text":
        column = data_args.text_column
        require_columns(ds.column_names, "text_column", [column], data_args.dataset)
        max_length = None if data_args.packing else data_args.block_size
        kwargs = {"tokenizer": tokenizer, "column": column, "max_length": max_length}
        return _map(ds, [column], tokenise_text_batch, TEXT_FEATURES, kwargs, workers, cache_file)
    kwargs = {
        "tokenizer": tokenizer,
        "fmt": fmt,
        "block_size": data_args.block_size,
        "long_rows": data_args.long_rows,
    }
    columns = format_columns(fmt, ds.column_names)
    rows = _map(ds, columns, tokenise_rows_batch, SFT_ROW_FEATURES, kwargs, workers, cache_file, True)
    _raise_row_problems(rows, key)
    return rows.remove_columns(["row", "problem"])


def _raise_row_problems(rows: datasets.Dataset, key: str) -> None:
    """One DataError listing the first rows with a problem, by index, one line each."""
    problems = rows.with_format("arrow")["problem"]
    bad = pc.indices_nonzero(pc.not_equal(problems, "")).to_pylist()
    if not bad:
        return
    listed = rows.select(bad[:MAX_LISTED_ROWS])
    lines = [(key, f"row {r}: {p}") for r, p in zip(listed["row"], listed["problem"], strict=True)]
    if len(bad) > MAX_LISTED_ROWS:
        lines.append((key, f"and {len(bad) - MAX_LISTED_ROWS} more rows with a problem"))
    raise DataError(lines)


def _kept(
    docs: datasets.Dataset, total: int, fmt: str, data_args: DataArguments, name: str, key: str
) -> None:
    """Refuse data with no row left; log how many rows were left out, and why."""
    if len(docs) == 0:
        what = "non-empty documents" if fmt == "text" else "rows that fit block_size"
        raise DataError([(key, f"{name}: no {what}")])
    if len(docs) < total:
        why = "empty text" if fmt == "text" else LEFT_OUT[data_args.long_rows]
        logger.info("%s: left out %d of %d rows (%s)", name, total - len(docs), total, why)


def _validation_rows(data_args: DataArguments, source: Source, fmt: str) -> datasets.Dataset:
    rows = load_validation(data_args, source)
    if len(rows) == 0:
        raise DataError([("validation_file", f"{source.name}: the dataset is empty")])
    needed = [data_args.text_column] if fmt == "text" else list(FORMAT_COLUMNS[fmt])
    require_columns(rows.column_names, "validation_file", needed, source.name)
    return rows


def _tokenised(
    data_args: DataArguments, tokenizer: Any, seed: int, raw: RawData, held_out: Source | None, base: Path
) -> tuple[str, datasets.Dataset, datasets.Dataset | None]:
    """(format, train rows, eval rows): the eval rows come from the validation file, else the
    source's own eval split, else a share of the train rows (none when nothing is held out)."""
    name = data_args.dataset
    if len(raw.train) == 0:
        raise DataError([("dataset", f"{name}: the dataset is empty")])
    fmt = resolve_format(data_args.data_format, raw.train.column_names, name, data_args.text_column)
    if fmt != data_args.data_format:
        logger.info("%s: data format %s (told from its columns)", name, fmt)
    docs = _tokenise(raw.train, fmt, data_args, tokenizer, base / "tokens.arrow", "dataset")
    _kept(docs, len(raw.train), fmt, data_args, name, "dataset")
    if held_out is not None:
        rows = _validation_rows(data_args, held_out, fmt)
        eval_docs = _tokenise(rows, fmt, data_args, tokenizer, base / "eval-tokens.arrow", "validation_file")
        _kept(eval_docs, len(rows), fmt, data_args, held_out.name, "validation_file")
        return fmt, docs, eval_docs
    if raw.eval is not None:
        eval_docs = _tokenise(raw.eval, fmt, data_args, tokenizer, base / "eval-tokens.arrow", "dataset")
        return fmt, docs, eval_docs
    train_idx, eval_idx = split_indices(len(docs), data_args.validation_split_percentage, seed)
    return fmt, docs.select(train_idx), docs.select(eval_idx) if eval_idx else None


def _build(
    data_args: DataArguments, tokenizer: Any, seed: int, raw: RawData, held_out: Source | None, base: Path
) -> None:
    base.mkdir(parents=True, exist_ok=True)
    fmt, train_docs, eval_docs = _tokenised(data_args, tokenizer, seed, raw, held_out, base)
    tmp = Path(tempfile.mkdtemp(prefix=".final.", dir=base))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        info: dict[str, Any] = {
            "dataset": data_args.dataset,
            "validation_file": data_args.validation_file,
            "data_format": data_args.data_format,
            "format": fmt,
            "block_size": data_args.block_size,
            "packing": data_args.packing,
            "seed": seed,
        }
        info["train"] = _write_split(train_docs, fmt, data_args, tmp / "train.arrow")
        info["eval"] = (
            _write_split(eval_docs, fmt, data_args, tmp / "eval.arrow") if eval_docs is not None else None
        )
        (tmp / "info.json").write_text(json.dumps(info, indent=2))
        try:
            os.rename(tmp, base / "final")
        except OSError:  # another rank finished first with the same result
            if not (base / "final" / "info.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "tokenised %s: train %s, eval %s; cached at %s",
        data_args.dataset,
        info["train"],
        info["eval"],
        base / "final",
    )


def _write_split(docs: datasets.Dataset, fmt: str, data_args: DataArguments, path: Path) -> dict[str, int]:
    block = data_args.block_size
    if fmt == "text":
        tables, features = (
            (pack_documents(docs, block), PACKED_FEATURES)
            if data_args.packing
            else (unpacked_rows(docs, ["input_ids"]), TEXT_FEATURES)
        )
    elif data_args.packing:
        tables, features = pack_rows(docs, block), SFT_PACKED_FEATURES
    else:
        tables, features = unpacked_rows(docs, ["input_ids", "labels"]), SFT_FEATURES
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
