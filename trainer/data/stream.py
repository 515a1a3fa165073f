"""Streamed corpora: local files read, tokenised and packed on the fly, mixed from several sources by
weight, and resumed exactly on any number of ranks.

**Order.** Every source's rows are dealt to ``lanes`` canonical lanes: with at least as many files as
lanes, lane ``c`` reads files ``c, c + lanes, ...``; with fewer, every file, keeping its rows whose
running number in the source is ``c`` modulo the lanes. A source that repeats is read epoch after
epoch, the running number going on: a lane of a source with fewer rows than lanes takes its rows
from later epochs, and blocks run on from one epoch into the next. A lane draws the source of its
``m``-th block from a hash of (seed, lane, m) by the sources' weights, packs that source's next
``block_size`` tokens (documents joined by EOS, ``position_ids`` restarting at each document and
block, as the map-style packing does), and shuffles its blocks ``shuffle_window`` at a time by a
permutation drawn from (seed, lane, window). The global sequence of blocks takes the lanes in turn:
block ``k`` is the ``k // lanes``-th block of lane ``k % lanes``. Nothing of this depends on the world
size.

**Ranks.** As with the map-style sampler, rank ``r`` of ``R`` readers takes global positions ``r, r + R,
...``; with ``lanes`` a multiple of ``R`` these all come from lanes ``r, r + R, ...``, taken in turn, so
a rank reads only its own lanes. DataLoader workers split a rank's lanes the same way (the DataLoader
takes its workers in turn too), so each lane is read by one process.

**Position.** Each block carries its lane's cursor after it: per source the file, row, byte offset and
the tokens of the current row already packed; the lane's draw count; the window it is in (as the
cursor at the window's start and the blocks taken of it). A checkpoint records every lane's cursor at
the step it was saved at (``StreamPosition.at``), so a resume on any number of ranks opens each file at
its offset and re-reads at most one window per lane: its cost does not grow with the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.processing import tokenise_rows_batch
from trainer.data.sources import DataError
from trainer.runtime.distributed import dist_info
from trainer.runtime.resilience import worker_crash_sample

logger = logging.getLogger(__name__)

LINE_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".text", ".md", ".py")  # one document per file, as the map-style reader
TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = LINE_SUFFIXES + TEXT_SUFFIXES + TABLE_SUFFIXES
# A stream's length for the run's plan: endless, so that max_steps ends the run inside one epoch.
STREAM_LENGTH = 1 << 60


class ShardError(DataError):
    """A streamed file that cannot be read, met by one rank while it trains: that rank reports it."""


def unreadable(source: StreamSource, shard: Any, err: Exception, policy: str) -> None:
    """A shard of ``source`` that cannot be read: a ShardError naming it and this rank (``stop``),
    or a warning (``skip``)."""
    where = source.shard_name(shard)
    message = f"{where} cannot be read on rank {dist_info().rank} ({type(err).__name__}: {str(err)[:200]})"
    if policy == "stop":
        raise ShardError([(source.key, message)]) from None
    logger.warning("skipped (unreadable_shards skip): %s", message)


def changed_sources(sources: list[StreamSource], saved: dict[str, Any]) -> None:
    """Refuse, naming the first, a source whose files are not those ``saved`` (a checkpoint's
    position fingerprint) recorded."""
    for source in sources:
        if saved.get("sources", {}).get(source.name) != source.fingerprint():
            raise DataError(
                [(source.key, "its files changed since the checkpoint (names, sizes or modification "
                  "times); pass --data_changed ok to resume anyway")]
            )  # fmt: skip


def _unit(*parts: Any) -> float:
    """A uniform number in [0, 1) from ``parts``: the same on every machine and process."""
    digest = hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] / 2.0**64


def _order(n: int, *parts: Any) -> list[int]:
    seed = int(_unit(*parts) * 2**32)
    return np.random.default_rng(seed).permutation(n).tolist()


@dataclass(frozen=True)
class StreamSource:
    """One source of a stream: its files (sorted), its weight in the mixture, the column holding its
    text, and what happens when a lane runs out of it: ``stop`` (the stream ends), ``repeat`` (it
    starts over in a new order) or ``drop`` (the other sources share its weight). A file is a shard:
    the unit lanes are dealt, read from a row and a byte offset. ``row_format``: ``text`` (documents
    in ``text_column``, packed token by token), an instruction format (``alpaca``, ``messages``, ...:
    rows tokenised with their labels, packed whole) or ``rows`` (samples already tokenised, taken
    whole, one a block)."""

    name: str
    files: tuple[Path, ...]
    weight: float = 1.0
    text_column: str = "text"
    on_end: str = "stop"
    key: str = ""  # the argument that names it, for errors (default: dataset_mixture.<name>)
    row_format: str = "text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self.key or f"dataset_mixture.{self.name}")

    @property
    def column(self) -> str | None:
        """The column a row's text is in; None: the whole row is read."""
        return self.text_column if self.row_format == "text" else None

    @property
    def shards(self) -> tuple[Any, ...]:
        return self.files

    def shard_name(self, shard: Any) -> str:
        return str(shard)

    def rows(self, shard: Any, row: int, at: Any) -> Iterator[tuple[int, Any, Any, Any]]:
        """(row index, where it starts, where the next starts, its value) from row ``row`` of
        ``shard``, which starts at ``at`` (a byte offset here); see ``read_rows``."""
        return read_rows(shard, self.column, row, at)

    def fingerprint(self) -> list[Any]:
        return [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]


@dataclass(frozen=True)
class DatasetSource(StreamSource):
    """A ``datasets.IterableDataset`` as a source (passed to the ``Trainer``, or what
    ``load_dataset(..., streaming=True)`` returns for a hub name or a URL): its shards are the
    dataset's, each resumed through ``datasets``' own ``state_dict`` taken before the row (for
    Arrow and Parquet shards a seek; for others ``datasets`` reads the shard up to the row)."""

    dataset: Any = None

    @property
    def shards(self) -> tuple[Any, ...]:
        return tuple(range(self.dataset.num_shards))

    def shard_name(self, shard: Any) -> str:
        return f"shard {shard} of {self.dataset.num_shards} of {self.name}"

    def rows(self, shard: Any, row: int, at: Any) -> Iterator[tuple[int, Any, Any, Any]]:
        part = self.dataset.shard(num_shards=self.dataset.num_shards, index=shard)
        if at:
            part.load_state_dict(at)
        try:
            for index, value in enumerate(part, start=row):
                after = part.state_dict()
                yield index, at, after, value if self.column is None else value.get(self.column)
                at = after
        except (OSError, ValueError):
            raise
        except Exception as err:  # datasets' own reading errors: the shard is named as a file's is
            raise OSError(f"{type(err).__name__}: {err}") from err

    def fingerprint(self) -> list[Any]:
        """What ``datasets`` says of the data (no files to stat): shards, features and its info's
        builder, config, version and checksums."""
        info = self.dataset.info
        parts = [self.dataset.num_shards, self.dataset.features, info.builder_name, info.config_name,
                 info.version, info.download_checksums]  # fmt: skip
        return json.loads(json.dumps(parts, default=str))


def row_text(value: Any, column: str | None) -> Any:
    """A row's text (None for none): a JSON line is parsed only here, for the lane that keeps it.
    ``column`` None: the row itself, a sample (a dict), or None."""
    if isinstance(value, bytes):
        record = json.loads(value) if value.strip() else None
        value = record if column is None or not isinstance(record, dict) else record.get(column)
    return value if isinstance(value, dict if column is None else str) else None


def read_rows(path: Path, column: str | None, row: int, offset: int) -> Iterator[tuple[int, int, int, Any]]:
    """(row index, its byte offset, the next row's, its text (``column`` None: the record), or a
    JSON line's bytes for ``row_text``) from row ``row`` on, which starts at byte ``offset`` in a
    line file. A text file is one row; JSON lines and tables a row a record."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        if row == 0:
            yield 0, 0, 0, path.read_text(encoding="utf-8")
        return
    if suffix in LINE_SUFFIXES:
        with path.open("rb") as f:
            f.seek(offset)
            for index, line in enumerate(iter(f.readline, b""), start=row):
                start, offset = offset, offset + len(line)
                yield index, start, offset, line
        return
    import pyarrow.parquet as pq
    from pyarrow import ipc

    if suffix == ".parquet":
        batches: Any = pq.ParquetFile(path).iter_batches(columns=column and [column], batch_size=1024)
    else:  # datasets' .arrow files are Arrow streams
        batches = ipc.open_stream(path.open("rb"))
    index = 0
    for batch in batches:
        if index + batch.num_rows > row:
            values = batch.column(column).to_pylist() if column else batch.to_pylist()
            for value in values[max(row - index, 0) :]:
                at = max(index, row)
                yield at, 0, 0, value if isinstance(value, str | dict) else None
                index = at + 1
        else:
            index += batch.num_rows


def _fresh() -> dict[str, int]:
    return {"epoch": 0, "file": 0, "row": 0, "byte": 0, "seen": 0, "used": 0}


class _SourceInLane:
    """One source's rows in one lane, tokenised on demand. ``cursor`` says where the lane is in it:
    the epoch (each a new file order), the file, the current row (index, byte offset and its running
    number ``seen`` in the source) and the tokens of that row already packed (``used``)."""

    def __init__(self, source: StreamSource, lane: int, stream: StreamedDataset):
        self.source, self.lane, self.stream = source, lane, stream
        shards = source.shards
        by_file = len(shards) >= stream.lanes
        self.files = list(shards[lane :: stream.lanes]) if by_file else list(shards)
        self.every = 1 if by_file else stream.lanes  # rows kept: running number = lane modulo this
        self.cursor = _fresh()
        self.rows: Iterator[tuple[int, int, int, str | bytes | None]] | None = None
        self.ids: list[int] = []  # the current row's tokens not packed yet
        self.next = (0, 0)  # the row after the current one: index, byte offset
        self._epoch_order: tuple[int, list[Path]] = (-1, [])  # (epoch, its shuffled files)

    def restart(self, cursor: dict[str, int]) -> None:
        self.cursor, self.rows, self.ids = dict(cursor), None, []

    def _path(self) -> Any:
        c = self.cursor
        if c["file"] >= len(self.files):
            return None
        if self.stream.shuffle and self._epoch_order[0] != c["epoch"]:  # drawn once an epoch
            # Lanes that share the files (dealt rows by their running number) read them in one order.
            keys = (self.stream.seed, self.source.name, self.lane if self.every == 1 else "all", c["epoch"])
            self._epoch_order = (c["epoch"], [self.files[i] for i in _order(len(self.files), *keys)])
        return (self._epoch_order[1] if self.stream.shuffle else self.files)[c["file"]]

    def _load(self) -> bool:
        """The current row's tokens from ``used`` on, in ``ids``; False at the end of the source: of
        its epoch, or (``repeat``) once the lane passed ``lanes`` of its places without a row, or
        read a whole epoch without one."""
        since, whole = self.cursor["seen"], False
        while True:
            begun = self.cursor["seen"]
            if self._epoch_rows():
                return True
            # A repeated source goes on in its next epoch, the running number too: a source with
            # fewer rows than lanes gives a lane its next row a few epochs on.
            seen = self.cursor["seen"]
            if self.source.on_end != "repeat" or seen - since >= self.every * self.stream.lanes:
                return False
            if whole and seen == begun:  # a whole epoch without rows
                return False
            self.next_epoch()
            whole = True

    def _epoch_rows(self) -> bool:
        """``_load`` within the epoch: False at its end."""
        c = self.cursor
        while (path := self._path()) is not None:
            if self.rows is None:
                self.rows = self.source.rows(path, c["row"], c["byte"])
            try:
                for index, start, after, value in self.rows:
                    c["row"], c["byte"] = index, start
                    mine = c["seen"] % self.every == self.lane % self.every
                    if mine and (text := row_text(value, self.source.column)):
                        ids = self.stream.encode(text, self.source.row_format, index)
                        if c["used"] < len(ids):
                            self.ids, self.next = ids[c["used"] :], (index + 1, after)
                            return True
                    c.update(row=index + 1, byte=after, seen=c["seen"] + 1, used=0)
            except (OSError, ValueError) as err:  # json and unicode errors are ValueErrors
                unreadable(self.source, path, err, self.stream.unreadable)
            self.rows = None
            c.update(file=c["file"] + 1, row=0, byte=0, used=0)
        return False

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """Up to ``n`` next tokens and each one's position in its document ([] at the epoch's end)."""
        ids: list[int] = []
        positions: list[int] = []
        while len(ids) < n and (self.ids or self._load()):
            k = min(n - len(ids), len(self.ids))
            used = self.cursor["used"]
            ids += self.ids[:k]
            positions += range(used, used + k)
            self.ids = self.ids[k:]
            self.cursor["used"] = used + k
            if not self.ids:  # past the row: the cursor names the next one
                row, byte = self.next
                self.cursor.update(row=row, byte=byte, seen=self.cursor["seen"] + 1, used=0)
        return ids, positions

    def take_rows(self, budget: int) -> tuple[list[dict[str, Any]], list[int]]:
        """Whole rows: the next one, and more while their tokens fit ``budget`` (0: one row)."""
        rows: list[dict[str, Any]] = []
        used = 0
        while self.ids or self._load():
            row = self.ids[0]
            n = len(row["input_ids"]) if budget else 0
            if rows and used + n > budget:
                break
            rows.append(row)
            used += n
            self.ids = []
            index, byte = self.next
            self.cursor.update(row=index, byte=byte, seen=self.cursor["seen"] + 1, used=0)
            if used >= budget:
                break
        return rows, []

    def next_epoch(self) -> None:
        """The next epoch's first row; the running number goes on (it deals rows over the epochs)."""
        self.restart({**_fresh(), "epoch": self.cursor["epoch"] + 1, "seen": self.cursor["seen"]})


class _Lane:
    """One canonical lane: its sources' rows mixed block by block, in shuffled windows."""

    def __init__(self, lane: int, stream: StreamedDataset):
        self.lane, self.stream = lane, stream
        self.parts = {s.name: _SourceInLane(s, lane, stream) for s in stream.sources}
        self.drawn = 0
        self.active = [s.name for s in stream.sources]

    def state(self) -> dict[str, Any]:
        cursors = {name: dict(part.cursor) for name, part in self.parts.items()}
        return {"drawn": self.drawn, "active": list(self.active), "sources": cursors}

    def restore(self, state: dict[str, Any]) -> None:
        self.drawn, self.active = state["drawn"], list(state["active"])
        for name, part in self.parts.items():
            part.restart(state["sources"][name])

    def _draw(self) -> str:
        weights = [self.stream.weights[name] for name in self.active]
        point = _unit(self.stream.seed, "mix", self.lane, self.drawn) * sum(weights)
        for name, weight in zip(self.active, weights, strict=True):
            point -= weight
            if point < 0:
                return name
        return self.active[-1]

    def block(self) -> dict[str, Any] | None:
        """The lane's next block, or None once a source under ``stop`` (or every source) ran out."""
        while self.active:
            name = self._draw()
            part = self.parts[name]
            items, positions = self.stream.take(part)  # a repeated source runs on into its next epoch
            if not items:
                if self.stream.on_end[name] == "stop":
                    return None
                self.active.remove(name)  # dropped, or repeated without rows for this lane
                continue
            self.drawn += 1
            return {**self.stream.block(items, positions, part.source.row_format), "source": name}
        if self.drawn == 0:  # the global order cannot pass over a lane: say why it would end here
            raise DataError(
                [("stream_lanes", f"lane {self.lane} of {self.stream.lanes} has no rows of any source (a source "
                  "under on_end drop with fewer rows than lanes leaves lanes without, as does one without "
                  "text); use fewer stream_lanes")]
            )  # fmt: skip
        return None

    def blocks(self, cursor: dict[str, Any] | None) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """(block, the lane's cursor after it) from ``cursor`` on (None: the start)."""
        cursor = cursor or {"start": self.state(), "window": 0, "taken": 0}
        self.restore(cursor["start"])
        window_no, taken, size = cursor["window"], cursor["taken"], self.stream.window
        while True:
            start, window = self.state(), []
            while len(window) < size and (block := self.block()) is not None:
                window.append(block)
            end = self.state()
            order = list(range(len(window)))
            if self.stream.shuffle and len(window) > 1:
                order = _order(len(window), self.stream.seed, "window", self.lane, window_no)
            for i in range(taken, len(window)):
                done = i + 1 == len(window)
                after = {
                    "start": end if done else start,
                    "window": window_no + done,
                    "taken": 0 if done else i + 1,
                }
                yield window[order[i]], after
            if len(window) < size:
                return
            window_no, taken = window_no + 1, 0


@dataclass
class StreamedDataset(IterableDataset):
    """A stream of packed blocks from ``sources`` (see the module's docstring). ``length``: the
    global samples the run plans to read (its steps times its global batch), which the loop counts
    epochs by; a stream has no length of its own. ``block_size`` None: the sources' rows are samples
    already, taken one a block (no tokenizer). ``packing`` and ``long_rows``: the instruction
    formats' (``DataArguments``)."""

    sources: list[StreamSource]
    tokenizer: Any
    block_size: int | None
    length: int
    lanes: int = 64
    window: int = 16
    shuffle: bool = True
    seed: int = 0
    unreadable: str = "stop"
    data_changed: str = "refuse"
    packing: bool = True
    long_rows: str = "truncate"
    weights: dict[str, float] = field(init=False)
    on_end: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.weights = {s.name: s.weight for s in self.sources}
        self.on_end = {s.name: s.on_end for s in self.sources}
        settings = {"lanes": self.lanes, "window": self.window, "shuffle": self.shuffle,
                    "seed": self.seed, "block_size": self.block_size}  # fmt: skip
        # What a resume must find unchanged: the order's settings and every source's files (as they
        # were when this run started).
        self._fingerprint = {"settings": settings, "sources": {s.name: s.fingerprint() for s in self.sources}}

    def __len__(self) -> int:
        return self.length

    def encode(self, text: Any, row_format: str, index: int) -> list[Any]:
        """A document's tokens and EOS, as the map-style tokenisation makes them; an instruction
        row (row ``index`` of its shard) as one item, its ``input_ids`` and ``labels`` (none when
        ``long_rows`` drops it; a row that cannot be used is a ValueError); a sample as it is."""
        if row_format == "rows":
            return [text]
        if row_format != "text":
            made = tokenise_rows_batch({k: [v] for k, v in text.items()}, [index], self.tokenizer, row_format,
                                       self.block_size, self.long_rows)  # fmt: skip
            if made["problem"] and made["problem"][0]:
                raise ValueError(f"row {index}: {made['problem'][0]}")
            return [
                {"input_ids": ids, "labels": labels}
                for ids, labels in zip(made["input_ids"], made["labels"], strict=True)
            ]
        eos = self.tokenizer.eos_token_id
        ids = self.tokenizer(text, add_special_tokens=True, split_special_tokens=True, verbose=False)[
            "input_ids"
        ]
        return ids if ids and ids[-1] == eos else [*ids, eos]

    def take(self, part: _SourceInLane) -> tuple[list[Any], list[int]]:
        """A block's items of one source: tokens and their positions (text), or whole rows."""
        if part.source.row_format == "text":
            return part.take(self.block_size)
        return part.take_rows(self.block_size if self.packing and part.source.row_format != "rows" else 0)

    def block(self, items: list[Any], positions: list[int], row_format: str) -> dict[str, Any]:
        """A block of ``take``'s items: ``position_ids`` restart at each document (and at the block)
        and at each instruction row; a sample is the block."""
        if row_format == "text":
            index = np.arange(len(items))
            position_ids = np.minimum(np.asarray(positions), index % self.block_size).tolist()
            return {"input_ids": items, "position_ids": position_ids}
        if row_format == "rows" or not self.packing:
            return items[0]
        return {
            "input_ids": [t for row in items for t in row["input_ids"]],
            "labels": [t for row in items for t in row["labels"]],
            "position_ids": [i for row in items for i in range(len(row["input_ids"]))],
        }

    def fingerprint(self) -> dict[str, Any]:
        return self._fingerprint

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every block in the global order, one process (what rank 0 of 1 reads)."""
        for _, _, block, _ in _RankView(self, list(range(self.lanes)), 0, {}):
            yield block


class _RankView(IterableDataset):
    """What a DataLoader over one rank's lanes iterates: (the rank's sample number, lane, block,
    lane cursor after it), each worker the samples ``start + worker + t * workers``."""

    def __init__(self, stream: StreamedDataset, lanes: list[int], start: int, cursors: dict[int, Any]):
        self.stream, self.lanes, self.start, self.cursors = stream, lanes, start, cursors

    def __iter__(self) -> Iterator[tuple[int, int, dict[str, Any], dict[str, Any]]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        n = len(self.lanes)
        first = self.start + worker
        mine = sorted({(first + t * workers) % n for t in range(n // workers)})
        streams = {i: _Lane(self.lanes[i], self.stream).blocks(self.cursors.get(self.lanes[i])) for i in mine}
        crash = worker_crash_sample() if info else None
        j = first
        while True:
            item = next(streams[j % n], None)
            if item is None:
                return
            if j == crash:  # a planned fault (tests): this worker dies as it reads the sample
                os.kill(os.getpid(), signal.SIGKILL)
            block, after = item
            yield j, self.lanes[j % n], block, after
            j += workers


def _as_is(item: Any) -> Any:
    return item


class StreamPosition:
    """A rank's place in a stream: what the sampler is to a map-style dataset. ``readers`` ranks read
    rows of their own (the layout's data ranks), this one is ``rank``; ``workers``: the DataLoader's."""

    def __init__(self, stream: StreamedDataset, readers: int, rank: int, workers: int = 0):
        lanes = stream.lanes
        if lanes % readers:
            raise DataError(
                [("stream_lanes", f"{lanes} lanes do not split over {readers} data-parallel ranks; "
                  f"use a multiple of {readers} (the order depends on it: keep it for the whole run)")]
            )  # fmt: skip
        if (lanes // readers) % max(workers, 1):
            raise DataError(
                [("stream_lanes, dataloader_num_workers", f"{lanes // readers} lanes a rank do not split "
                  f"over {workers} workers; use a worker count that divides {lanes // readers}")]
            )  # fmt: skip
        self.stream, self.workers = stream, workers
        self.lanes = list(range(rank, lanes, readers))
        self.start, self.cursors = 0, {}
        self.history: list[tuple[int, int, dict[str, Any]]] = []  # (sample number, lane, cursor after)
        self.epoch = 0
        self.taken = dict.fromkeys(stream.weights, 0)  # blocks of each source read since ``take_counts``

    def set_epoch(self, epoch: int, start: int = 0, position: dict[str, Any] | None = None) -> None:
        """Resume at this rank's sample ``start`` from a checkpoint's ``position`` (None: the start)."""
        if position is not None:
            self._check(position)
        self.epoch, self.start = epoch, start
        self.cursors = {int(k): v for k, v in (position or {}).get("lanes", {}).items()} if start else {}
        self.history, self.taken = [], dict.fromkeys(self.taken, 0)

    def _check(self, position: dict[str, Any]) -> None:
        saved, now = position.get("fingerprint", {}), self.stream.fingerprint()
        if saved.get("settings") != now["settings"]:
            raise DataError(
                [("resume_from_checkpoint", f"the checkpoint's stream was read with {saved.get('settings')}, "
                  f"this run with {now['settings']}; the order would not continue")]
            )  # fmt: skip
        if self.stream.data_changed != "ok":
            changed_sources(self.stream.sources, saved)

    def blocks(self) -> Iterator[dict[str, Any]]:
        """This rank's blocks from ``start`` on, each remembered with its lane's cursor after it."""
        view = _RankView(self.stream, self.lanes, self.start, self.cursors)
        loader = DataLoader(view, batch_size=None, num_workers=self.workers, collate_fn=_as_is)
        expected = self.start
        for j, lane, block, after in loader:
            if j != expected:  # a worker's lane ended: the rank's order ends here
                return
            self.history.append((j, lane, after))
            self.taken[block["source"]] += 1
            expected += 1
            yield {key: value for key, value in block.items() if key != "source"}

    def take_counts(self) -> dict[str, int]:
        """The blocks of each source read since the last call: a window's, when called as the window
        trains (``blocks`` reads nothing ahead of the window)."""
        counts, self.taken = self.taken, dict.fromkeys(self.taken, 0)
        return counts

    def position(self, consumed: int) -> dict[str, Any]:
        """This rank's lanes' cursors after its first ``consumed`` samples (what a checkpoint saved at
        that point records, gathered over the ranks), and the stream's fingerprint."""
        cursors = dict(self.cursors)
        for j, lane, after in self.history:
            if j < consumed:
                cursors[lane] = after
        self.cursors = cursors
        self.history = [entry for entry in self.history if entry[0] >= consumed]
        return {"lanes": {str(k): v for k, v in cursors.items()}, "fingerprint": self.stream.fingerprint()}
