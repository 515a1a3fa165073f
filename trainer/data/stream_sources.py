"""A run's streamed sources from its data arguments: ``dataset`` (with ``streaming``) or the sources of
``dataset_mixture``, each a directory, a file, a glob of files or the standard library, resolved to a
sorted list of files before anything is read; or a hub name or a URL (``s3://``, ``hf://``, ...),
which ``datasets`` streams (``load_dataset(..., streaming=True)``). And the stream a ``Trainer``
makes of a ``datasets.IterableDataset`` it is given."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from trainer.args import DataArguments
from trainer.data.formats import resolve_format, row_strings
from trainer.data.loader import data_seed
from trainer.data.sources import STDLIB, DataError, corpus_files, looks_local
from trainer.data.stream import (
    STREAM_LENGTH,
    SUFFIXES,
    TEXT_SUFFIXES,
    DatasetSource,
    StreamedDataset,
    StreamSource,
    changed_sources,
    row_text,
    unreadable,
)

# datasets' builder for a URL's files, by suffix (the local reader's kinds).
URL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _files(spec: str, key: str) -> tuple[Path, ...] | None:
    """The files ``spec`` names, sorted; None for a hub name or a URL."""
    if spec == STDLIB:
        return tuple(corpus_files())
    path = Path(spec).expanduser()
    if "://" in spec or not (path.exists() or looks_local(spec) or any(ch in spec for ch in "*?[")):
        return None
    if any(ch in spec for ch in "*?["):
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        found = list(path.rglob("*"))
    elif path.is_file():
        found = [path]
    else:
        raise DataError([(key, f"no such file or directory: {spec}")])
    files = sorted(p for p in found if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise DataError([(key, f"no files to stream ({', '.join(SUFFIXES)}) in {spec}")])
    return tuple(files)


def _remote(spec: str, key: str, column: str | None, config: str | None) -> Any:
    """``datasets``' stream of a hub name or a URL's files (their suffix says how to read them)."""
    import datasets

    suffix = Path(spec.split("?")[0]).suffix.lower()
    if "://" in spec:
        builder = URL_BUILDERS.get(suffix, "text" if suffix in TEXT_SUFFIXES else None)
        if builder is None:
            raise DataError([(key, f"{spec}: cannot tell how to read {suffix or 'files without a suffix'} "
                              f"({', '.join(SUFFIXES)})")])  # fmt: skip
        found = {
            "path": builder,
            "data_files": spec,
            **({"sample_by": "document"} if builder == "text" else {}),
        }
    else:
        found = {"path": spec, "name": config}
    try:
        dataset = datasets.load_dataset(**found, split="train", streaming=True)
    except Exception as err:
        first = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise DataError(
            [(key, f"{spec!r} is not a local path, and datasets could not stream it: {first}")]
        ) from None
    if column and dataset.column_names is not None and column not in dataset.column_names:
        raise DataError(
            [(key, f"{spec} has no column {column!r} (its columns: {', '.join(dataset.column_names)})")]
        )
    return dataset


def _source(
    spec: str, key: str, name: str, weight: float, column: str, on_end: str, data_args: DataArguments
) -> StreamSource:
    """One source: its files, or datasets' stream of it; the instruction format told from its first row's
    columns (``data_format sft``), or checked against them."""
    files, fmt = _files(spec, key), data_args.data_format
    named = key if key == "dataset" else ""  # a mixture's source is named by its name once it reads
    if files is not None:
        source = StreamSource(name, files, weight, column, on_end, key=named, row_format=fmt)
    else:
        dataset = _remote(spec, key, column if fmt == "text" else None, data_args.dataset_config)
        source = DatasetSource(name, (), weight, column, on_end, key=named, row_format=fmt, dataset=dataset)
    if fmt == "text":
        return source
    first = next(
        (row_text(v, None) for shard in source.shards[:1] for *_, v in source.rows(shard, 0, 0)), None
    )
    return replace(source, row_format=resolve_format(fmt, list(first or {}), spec, column))


def _name(spec: str) -> str:
    """A source's name from its path or URL: its last part that is not a pattern, without suffix."""
    plain = [part for part in Path(spec.split("://")[-1]).parts if not any(ch in part for ch in "*?[")]
    return Path(*plain).stem if plain else ""


def stream_sources(data_args: DataArguments) -> list[StreamSource]:
    """The sources of a streamed run, their files listed and checked (one DataError naming the key)."""
    if not data_args.dataset_mixture:
        spec, name = data_args.dataset, _name(data_args.dataset) or "dataset"
        return [_source(spec, "dataset", name, 1.0, data_args.text_column, "repeat", data_args)]
    sources, names = [], set()
    for i, item in enumerate(data_args.dataset_mixture):
        key = f"dataset_mixture.{i}.dataset"
        name = item.name or _name(item.dataset) or f"source{i}"
        if name in names:
            raise DataError([(f"dataset_mixture.{i}.name", f"{name!r} names two sources; give each a name")])
        names.add(name)
        sources.append(
            _source(item.dataset, key, name, item.weight, item.text_column, item.on_end, data_args)
        )
    return sources


def readable(dataset: Any, args: Any, evaluation: bool = False) -> Any:
    """``dataset`` as the ``Trainer`` reads it: an ``IterableDataset`` made a stream to train on, or
    read whole into memory to evaluate on (an evaluation set is finite, and every rank takes its
    share of the same rows); others as they are."""
    if not isinstance(dataset, IterableDataset) or isinstance(dataset, StreamedDataset):
        return dataset
    if evaluation:
        import datasets

        return datasets.Dataset.from_list(list(dataset))
    return iterable_stream(dataset, args, data_seed(args))


def iterable_stream(dataset: Any, args: Any, seed: int) -> StreamedDataset:
    """The stream a ``Trainer`` reads of a ``datasets.IterableDataset`` of samples (rows already
    tokenised, as HF's Trainer takes them): its rows dealt to 64 lanes by its shards, in the
    dataset's own order whatever ``train_sampling_strategy`` says (HF's Trainer ignores it for an
    ``IterableDataset``), resumed exactly on any number of ranks. ``max_steps`` must be set: a
    stream has no length."""
    import datasets

    if not isinstance(dataset, datasets.IterableDataset):
        raise ValueError(
            "train_dataset: a torch IterableDataset has no shards to deal to ranks and no state to resume "
            "from; pass a datasets.IterableDataset (datasets.IterableDataset.from_generator, "
            "Dataset.to_iterable_dataset or load_dataset(..., streaming=True))"
        )
    if args.train_sampling_strategy == "group_by_length":
        raise ValueError(
            "train_sampling_strategy: group_by_length needs every row's length; a stream has none"
        )
    if args.max_steps <= 0:
        raise ValueError(
            "max_steps: a streamed train_dataset has no length to count epochs by; set max_steps"
        )
    source = DatasetSource(
        "train_dataset", (), 1.0, "", "stop", key="train_dataset", row_format="rows", dataset=dataset
    )
    return StreamedDataset([source], None, None, STREAM_LENGTH, window=1, shuffle=False, seed=seed)


def build_stream(
    data_args: DataArguments, tokenizer: Any, seed: int, length: int, shuffle: bool
) -> StreamedDataset:
    """The run's stream: ``length`` global samples planned (steps x global batch)."""
    return StreamedDataset(
        stream_sources(data_args),
        tokenizer,
        data_args.block_size,
        length,
        lanes=data_args.stream_lanes,
        window=data_args.stream_shuffle_window if shuffle else 1,
        shuffle=shuffle,
        seed=seed,
        unreadable=data_args.unreadable_shards,
        data_changed=data_args.data_changed,
        packing=data_args.packing,
        long_rows=data_args.long_rows,
    )


def stream_texts(sources: list[StreamSource], policy: str = "stop") -> Iterator[str]:
    """Every source's texts in file order: what a tokenizer trained for a stream reads (capped)."""
    for source in sources:
        for shard in source.shards:
            try:
                for _, _, _, value in source.rows(shard, 0, 0):
                    text = row_text(value, source.column)
                    yield from [text] if isinstance(text, str) else row_strings(source.row_format, text or {})
            except (OSError, ValueError) as err:
                unreadable(source, shard, err, policy)


def check_resumable(data_args: DataArguments, checkpoint: Path) -> None:
    """Before anything loads: a streamed run's sources against the position ``checkpoint`` recorded
    (refused by name when changed, unless ``data_changed ok``)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = (state.get("data_position") or {}).get("fingerprint")
    if saved is not None and data_args.data_changed != "ok":
        changed_sources(stream_sources(data_args), saved)


def streams_fingerprint(sources: list[StreamSource]) -> list[Any]:
    return [[s.name, s.fingerprint()] for s in sources]
