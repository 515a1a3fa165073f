"""Streams (trainer.data.stream) on one process: the global order does not depend on the number of
ranks or DataLoader workers, a resume from a recorded position continues it exactly on any number of
ranks, a mixture realises its weights, sources end by their policy, a stream without shuffling reads
the map-style packing's blocks, and bad input is named."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch

from tests.helpers.sft_data import SYSTEM, TURNS, sft_args, sharegpt_row
from tests.helpers.sft_data import tokenizer as sft_tokenizer
from trainer.args import DataArguments, TrainingArguments
from trainer.data import build_datasets
from trainer.data.processing import pack_documents, tokenise_text_batch
from trainer.data.sources import DataError, corpus_files
from trainer.data.stream import (
    DatasetSource,
    ShardError,
    StreamedDataset,
    StreamPosition,
    StreamSource,
    _Lane,
)
from trainer.data.stream_sources import readable, stream_sources
from trainer.data.tokenizer import train_bpe_tokenizer

# Small modules of the standard library, in a fixed order: documents of a few hundred tokens.
STDLIB = [p for p in corpus_files() if 500 < p.stat().st_size < 8000][:90]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer((p.read_text() for p in STDLIB[:20]), vocab_size=400)


def _shards(root: Path, name: str, files: list[Path], shards: int) -> Path:
    """The texts of ``files`` as ``shards`` JSON-lines files under ``root/name``."""
    folder = root / name
    folder.mkdir(parents=True)
    for k in range(shards):
        with (folder / f"part-{k:02d}.jsonl").open("w") as f:
            for path in files[k::shards]:
                f.write(json.dumps({"text": path.read_text(), "other": 1}) + "\n")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    return {
        "a": _shards(root, "a", STDLIB[0:40], 3),
        "b": _shards(root, "b", STDLIB[40:70], 2),
        "c": _shards(root, "c", STDLIB[70:90], 1),
    }


def _source(folder: Path, **kw) -> StreamSource:
    """The folder's shards as a source; endless (repeated) unless told otherwise."""
    return StreamSource(folder.name, tuple(sorted(folder.glob("*.jsonl"))), **{"on_end": "repeat", **kw})


def _stream(tokenizer, sources, **kw) -> StreamedDataset:
    settings = dict(lanes=8, window=4, seed=3, length=10**9)
    return StreamedDataset(sources, tokenizer, 32, **{**settings, **kw})


def _key(block: dict) -> tuple[int, ...]:
    return tuple(block["input_ids"])


def _read(position: StreamPosition, n: int) -> list[tuple[int, ...]]:
    blocks = position.blocks()
    return [_key(next(blocks)) for _ in range(n)]


def _ranks(make, readers: int, per_rank: int, start: int = 0, saved=None, workers: int = 0):
    """The global sequence read by ``readers`` ranks (each ``per_rank`` samples from ``start``)."""
    positions = [StreamPosition(make(), readers, r, workers) for r in range(readers)]
    for p in positions:
        p.set_epoch(0, start, saved)
    reads = [_read(p, per_rank) for p in positions]
    return [reads[r][j] for j in range(per_rank) for r in range(readers)], positions


def _saved(positions: list[StreamPosition], consumed: int) -> dict:
    parts = [p.position(consumed) for p in positions]
    return {
        "lanes": {k: v for part in parts for k, v in part["lanes"].items()},
        "fingerprint": parts[0]["fingerprint"],
    }


def test_the_order_is_the_same_on_any_number_of_ranks_and_workers(tokenizer, corpus):
    make = lambda: _stream(tokenizer, [_source(corpus["a"]), _source(corpus["b"], weight=0.5)])  # noqa: E731
    one = [_key(b) for _, b in zip(range(48), make(), strict=False)]
    assert len(set(one)) == 48
    for readers, workers in ((1, 2), (2, 0), (4, 2), (8, 0)):
        seen, _ = _ranks(make, readers, 48 // readers, workers=workers)
        assert seen == one, (readers, workers)


@pytest.mark.parametrize("saved_on, resumed_on, workers", [(2, 2, 0), (2, 1, 0), (2, 4, 0), (4, 2, 2)])
def test_a_resume_continues_the_order_on_any_number_of_ranks(
    tokenizer, corpus, saved_on, resumed_on, workers
):
    """Positions recorded after 24 global samples (the read-ahead beyond them is not part of it)."""
    make = lambda: _stream(tokenizer, [_source(corpus["a"]), _source(corpus["c"], weight=0.3)])  # noqa: E731
    one = [_key(b) for _, b in zip(range(56), make(), strict=False)]
    _, positions = _ranks(make, saved_on, 32 // saved_on)  # read ahead of the saved point
    saved = _saved(positions, 24 // saved_on)
    again, _ = _ranks(
        make, resumed_on, 32 // resumed_on, start=24 // resumed_on, saved=saved, workers=workers
    )
    assert again == one[24:56]


def test_a_mixture_realises_its_weights(tokenizer, corpus):
    """2,000 blocks drawn 0.5 / 0.3 / 0.2: each share within 4 standard deviations of a binomial
    share, sqrt(p (1 - p) / 2000) (0.045 for 0.5): the draws are independent hashes."""
    sources = [
        _source(corpus["a"], weight=0.5),
        _source(corpus["b"], weight=0.3),
        _source(corpus["c"], weight=0.2),
    ]
    counts = Counter(
        block["source"] for _, block in zip(range(2000), _stream(tokenizer, sources), strict=False)
    )
    assert sum(counts.values()) == 2000
    for name, p in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert abs(counts[name] / 2000 - p) < 4 * math.sqrt(p * (1 - p) / 2000), counts


def test_sources_end_by_their_policy(tokenizer, corpus):
    """c under stop ends the stream once it is read through; under drop a goes on alone; under
    repeat c starts over."""
    c_alone = len(list(_stream(tokenizer, [_source(corpus["c"], on_end="stop")], lanes=1, window=1)))
    a_alone = len(list(_stream(tokenizer, [_source(corpus["a"], on_end="stop")], lanes=1, window=1)))
    a = _source(corpus["a"], on_end="stop")
    for policy in ("stop", "drop"):
        c = _source(corpus["c"], on_end=policy)
        got = Counter(b["source"] for b in _stream(tokenizer, [a, c], lanes=1, window=1))
        assert got["c"] == c_alone, policy
        assert got["a"] < a_alone if policy == "stop" else got["a"] == a_alone  # then a's own stop
    repeated = _stream(tokenizer, [_source(corpus["c"], on_end="repeat")], lanes=1, window=1)
    assert len([b for _, b in zip(range(3 * c_alone), repeated, strict=False)]) == 3 * c_alone


def test_a_shuffled_epoch_reads_every_document_once(tokenizer, corpus):
    """Two files dealt to 8 lanes by row number, each lane in its own shuffled windows: every token
    of the source, once, in an epoch (the lanes read the files in one shared order)."""
    stream = _stream(tokenizer, [_source(corpus["b"], on_end="stop")])
    lanes = [_Lane(lane, stream).blocks(None) for lane in range(stream.lanes)]  # each read to its end
    read = Counter(token for blocks in lanes for block, _ in blocks for token in block["input_ids"])
    texts = [json.loads(line)["text"] for f in sorted(corpus["b"].glob("*.jsonl")) for line in f.open()]
    assert read == Counter(token for text in texts for token in stream.encode(text, "text", 0))


def test_without_shuffling_one_lane_reads_the_map_style_blocks(tokenizer, corpus):
    files = sorted(corpus["a"].glob("*.jsonl"))
    texts = [json.loads(line)["text"] for f in files for line in f.read_text().splitlines()]
    import datasets

    docs = datasets.Dataset.from_dict(tokenise_text_batch({"text": texts}, tokenizer, "text", None))
    want = [row for table in pack_documents(docs, 32) for row in table.to_pylist()]
    got = list(_stream(tokenizer, [_source(corpus["a"], on_end="stop")], lanes=1, window=1, shuffle=False))
    assert [b["input_ids"] for b in got] == [r["input_ids"] for r in want]
    assert [b["position_ids"] for b in got] == [r["position_ids"] for r in want]


def test_a_changed_source_is_refused_unless_told(tokenizer, corpus, tmp_path):
    folder = _shards(tmp_path, "d", STDLIB[:6], 2)
    positions = [StreamPosition(_stream(tokenizer, [_source(folder)]), 1, 0)]
    positions[0].set_epoch(0)
    _read(positions[0], 4)
    saved = _saved(positions, 4)
    with (folder / "part-00.jsonl").open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    again = StreamPosition(_stream(tokenizer, [_source(folder)]), 1, 0)
    with pytest.raises(DataError, match=r"dataset_mixture\.d: its files changed since the checkpoint"):
        again.set_epoch(0, 4, saved)
    told = StreamPosition(_stream(tokenizer, [_source(folder)], data_changed="ok"), 1, 0)
    told.set_epoch(0, 4, saved)


def test_an_unreadable_shard_is_named_or_skipped(tokenizer, tmp_path):
    folder = _shards(tmp_path, "e", STDLIB[:4], 2)
    (folder / "part-01.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ShardError, match=r"part-01\.jsonl cannot be read on rank 0 \(JSONDecodeError"):
        list(_stream(tokenizer, [_source(folder, on_end="stop")], lanes=1))
    skipped = list(_stream(tokenizer, [_source(folder, on_end="stop")], lanes=1, unreadable="skip"))
    assert skipped


def test_lanes_and_workers_must_split_evenly(tokenizer, corpus):
    stream = _stream(tokenizer, [_source(corpus["a"])])
    with pytest.raises(DataError, match="stream_lanes: 8 lanes do not split over 3 data-parallel ranks"):
        StreamPosition(stream, 3, 0)
    with pytest.raises(DataError, match="stream_lanes, dataloader_num_workers: 4 lanes a rank"):
        StreamPosition(stream, 2, 0, workers=3)


def test_sources_from_the_arguments_are_checked_before_reading(corpus, tmp_path):
    mixture = [
        {"dataset": str(corpus["a"]), "weight": 0.7},
        {"dataset": str(corpus["b"] / "*.jsonl"), "weight": 0.3},
    ]
    sources = stream_sources(DataArguments(streaming=True, dataset_mixture=mixture))
    assert [(s.name, len(s.files), s.weight) for s in sources] == [("a", 3, 0.7), ("b", 2, 0.3)]
    with pytest.raises(DataError, match=r"dataset_mixture\.1\.dataset: no such file or directory"):
        stream_sources(
            DataArguments(streaming=True, dataset_mixture=[*mixture[:1], {"dataset": str(tmp_path / "x")}])
        )


def test_a_source_with_fewer_rows_than_lanes(tokenizer, tmp_path):
    """Three documents dealt to 8 lanes. Repeated (what ``--dataset`` is), the running number goes on
    over the epochs: lane c's first row is the (c mod 3)-th, every block is full, and a position
    saved on 2 ranks resumes on 1 and 4. Under drop, lane 3 has none, and the order cannot pass
    over it: named (under stop, the data ends there)."""
    folder = _shards(tmp_path, "few", STDLIB[:3], 1)
    stream = _stream(tokenizer, [_source(folder)], shuffle=False, window=1)
    docs = [stream.encode(json.loads(line)["text"], "text", 0) for line in (folder / "part-00.jsonl").open()]
    blocks = [b["input_ids"] for _, b in zip(range(8 * 40), stream, strict=False)]
    assert blocks[:8] == [docs[c % 3][:32] for c in range(8)]
    assert {len(b) for b in blocks} == {32}
    make = lambda: _stream(tokenizer, [_source(folder)])  # noqa: E731
    one = [_key(b) for _, b in zip(range(56), make(), strict=False)]
    _, positions = _ranks(make, 2, 16)
    for readers in (1, 4):
        again, _ = _ranks(make, readers, 32 // readers, start=24 // readers, saved=_saved(positions, 12))
        assert again == one[24:56], readers
    with pytest.raises(DataError, match="stream_lanes: lane 3 of 8 has no rows of any source"):
        list(_stream(tokenizer, [_source(folder, on_end="drop")]))
    assert len(list(_stream(tokenizer, [_source(folder, on_end="stop")]))) == 3


def _hf_source(folder: Path, **kw) -> DatasetSource:
    """The folder's shards as ``datasets`` streams them (a URL's files, read by datasets' builder)."""
    files = [f"file://{p}" for p in sorted(folder.glob("*.jsonl"))]
    dataset = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    return DatasetSource(folder.name, (), text_column="text", **{"on_end": "repeat", **kw}, dataset=dataset)


def test_a_datasets_stream_reads_and_resumes_as_the_files_do(tokenizer, corpus):
    """The same shards read by ``datasets`` (each resumed through its state_dict) and by the file
    reader (each from a byte offset): the same global order, and a resume saved on 2 ranks in each
    lane's second window continues it on 1 and 4."""
    files = lambda: _stream(tokenizer, [_source(corpus["a"]), _source(corpus["c"], weight=0.3)])  # noqa: E731
    hf = lambda: _stream(tokenizer, [_hf_source(corpus["a"]), _hf_source(corpus["c"], weight=0.3)])  # noqa: E731
    one = [_key(b) for _, b in zip(range(72), files(), strict=False)]
    assert [_key(b) for _, b in zip(range(72), hf(), strict=False)] == one
    _, positions = _ranks(hf, 2, 24)
    saved = _saved(positions, 20)
    starts = [c["byte"] for lane in saved["lanes"].values() for c in lane["start"]["sources"].values()]
    assert any(isinstance(at, dict) and at["epoch"] == 0 for at in starts)  # datasets' own states
    for readers in (1, 4):
        again, _ = _ranks(hf, readers, 32 // readers, start=40 // readers, saved=saved)
        assert again == one[40:72], readers


def _samples(n: int, shards: int) -> datasets.IterableDataset:
    rows = {
        "input_ids": [[i, i + 1, i + 2] for i in range(n)],
        "labels": [[i, i + 1, i + 2] for i in range(n)],
    }
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=shards)


def test_a_trainers_iterable_dataset_is_a_resumable_stream_of_its_rows():
    """Rows already tokenised, taken whole, in the dataset's order whatever
    ``train_sampling_strategy`` says (HF's Trainer reads an IterableDataset so); a resume on another
    number of ranks continues it."""
    args = TrainingArguments(output_dir="unused", max_steps=5)  # train_sampling_strategy "random"
    first = lambda block: block["input_ids"][0]  # noqa: E731
    for strategy in ("random", "sequential"):
        stream = readable(_samples(200, 4), args.model_copy(update={"train_sampling_strategy": strategy}))
        assert [first(b) for b in stream] == list(range(200)), strategy
    make = lambda: readable(_samples(200, 4), args)  # noqa: E731
    _, positions = _ranks(make, 2, 60)
    again, _ = _ranks(make, 4, 25, start=25, saved=_saved(positions, 50))
    assert [row[0] for row in again] == list(range(100, 200))
    assert set(next(iter(stream))) == {"input_ids", "labels", "source"}
    held = readable(_samples(8, 2), args, evaluation=True)  # an evaluation set: read whole
    assert isinstance(held, datasets.Dataset) and held.to_list() == list(_samples(8, 1))


def test_streams_the_trainer_refuses(corpus, tmp_path):
    args = TrainingArguments(output_dir="unused", max_steps=5)
    with pytest.raises(ValueError, match="train_dataset: a torch IterableDataset has no shards"):
        readable(_RowsOnly(), args)
    with pytest.raises(ValueError, match="max_steps: a streamed train_dataset has no length"):
        readable(_samples(8, 1), TrainingArguments(output_dir="unused"))
    with pytest.raises(ValueError, match="train_sampling_strategy: group_by_length needs every row's length"):
        readable(_samples(8, 1), args.model_copy(update={"train_sampling_strategy": "group_by_length"}))
    url = f"file://{corpus['a']}/*.jsonl"
    with pytest.raises(DataError, match=r"dataset: .* has no column 'content' \(its columns: text, other\)"):
        stream_sources(DataArguments(streaming=True, dataset=url, text_column="content"))
    with pytest.raises(DataError, match=r"dataset: file://.*\.csv: cannot tell how to read \.csv"):
        stream_sources(DataArguments(streaming=True, dataset=f"file://{tmp_path}/*.csv"))
    (source,) = stream_sources(DataArguments(streaming=True, dataset=url))
    assert isinstance(source, DatasetSource) and source.name == "a" and len(source.shards) == 3


class _RowsOnly(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": [1, 2]}


@pytest.mark.parametrize("packing", [True, False])
def test_instruction_rows_stream_as_the_builder_makes_them(tmp_path, packing):
    """ShareGPT chats (``data_format sft``, the format told from the first row) streamed in one
    unshuffled lane: the builder's rows, labels and position_ids, block for block; packed, a block
    takes whole rows while the next fits."""
    tok = sft_tokenizer()
    chats = [sharegpt_row(TURNS[: 1 + i % 3], system=None if i % 2 else SYSTEM) for i in range(20)]
    args = sft_args(tmp_path, chats, block_size=96, packing=packing)
    built = build_datasets(args, tok, seed=0)[0].to_list()
    (source,) = stream_sources(args.model_copy(update={"streaming": True}))
    assert source.row_format == "sharegpt"
    settings = dict(lanes=1, window=1, shuffle=False, packing=packing)
    stream = StreamedDataset([replace(source, on_end="stop")], tok, 96, 10**9, **settings)
    got = [{k: v for k, v in b.items() if k != "source"} for b in stream]
    assert got == built[: len(got)] and len(got) == len(built)
    assert (len(got) < len(chats)) == packing
