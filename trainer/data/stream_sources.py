"""A run's streamed sources from its data arguments: ``dataset`` (with ``streaming``) or the sources of
``dataset_mixture``, each a directory, a file, a glob of files or the standard library, resolved to a
sorted list of files before anything is read."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.args import DataArguments
from trainer.data.sources import STDLIB, DataError, corpus_files
from trainer.data.stream import (
    SUFFIXES,
    StreamedDataset,
    StreamSource,
    changed_sources,
    read_rows,
    row_text,
    unreadable,
)


def _files(spec: str, key: str) -> tuple[Path, ...]:
    if spec == STDLIB:
        return tuple(corpus_files())
    path = Path(spec).expanduser()
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


def stream_sources(data_args: DataArguments) -> list[StreamSource]:
    """The sources of a streamed run, their files listed and checked (one DataError naming the key)."""
    if not data_args.dataset_mixture:
        files = _files(data_args.dataset, "dataset")
        name = Path(data_args.dataset).stem or "dataset"
        return [StreamSource(name, files, 1.0, data_args.text_column, "repeat", key="dataset")]
    sources, names = [], set()
    for i, item in enumerate(data_args.dataset_mixture):
        key = f"dataset_mixture.{i}.dataset"
        plain = [part for part in Path(item.dataset).parts if not any(ch in part for ch in "*?[")]
        name = item.name or (Path(*plain).stem if plain else f"source{i}")
        if name in names:
            raise DataError([(f"dataset_mixture.{i}.name", f"{name!r} names two sources; give each a name")])
        names.add(name)
        sources.append(
            StreamSource(name, _files(item.dataset, key), item.weight, item.text_column, item.on_end)
        )
    return sources


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
    )


def stream_texts(sources: list[StreamSource], policy: str = "stop") -> Iterator[str]:
    """Every source's texts in file order: what a tokenizer trained for a stream reads (capped)."""
    for source in sources:
        for path in source.files:
            try:
                for _, _, _, value in read_rows(path, source.text_column, 0, 0):
                    if text := row_text(value, source.text_column):
                        yield text
            except (OSError, ValueError) as err:
                unreadable(source, path, err, policy)


def check_resumable(data_args: DataArguments, checkpoint: Path) -> None:
    """Before anything loads: a streamed run's sources against the position ``checkpoint`` recorded
    (refused by name when changed, unless ``data_changed ok``)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = (state.get("data_position") or {}).get("fingerprint")
    if saved is not None and data_args.data_changed != "ok":
        changed_sources(stream_sources(data_args), saved)


def streams_fingerprint(sources: list[StreamSource]) -> list[Any]:
    return [[s.name, s.fingerprint()] for s in sources]
