"""One rank's training DataLoader and its accumulation windows, in the sampler's (resumable) order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainer.data.sampler import ResumableDistributedSampler
from trainer.data.stream import StreamedDataset, StreamPosition

Batch = dict[str, torch.Tensor]


def data_seed(args: Any) -> int:
    """The seed of the data order: HF's ``data_seed``, else ``seed``."""
    return args.seed if args.data_seed is None else args.data_seed


def sample_lengths(dataset: Any, args: Any) -> list[int] | None:
    """The lengths ``train_sampling_strategy="group_by_length"`` orders by (None otherwise), as HF
    takes them: the ``length_column_name`` column where the dataset has one, else each row's
    ``input_ids`` length (a preference pair's: its longer sequence). Read before the dataset is cut
    to the model's inputs."""
    # A stream (an IterableDataset) has no lengths: trainer.data.stream_sources.readable refuses it.
    if (
        dataset is None
        or args.train_sampling_strategy != "group_by_length"
        or isinstance(dataset, IterableDataset)
    ):
        return None
    columns = getattr(dataset, "column_names", None) or []
    if args.length_column_name in columns:
        return [int(n) for n in dataset[args.length_column_name]]
    if "input_ids" in columns:
        return [len(ids) for ids in dataset["input_ids"]]
    if "prompt_ids" in columns:  # trainer.data.preference's pairs
        ids = (dataset[c] for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
        return [len(p) + max(len(c), len(r)) for p, c, r in zip(*ids, strict=True)]
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def train_sampler(
    dataset: Any, num_replicas: int, rank: int, args: Any, lengths: list[int] | None = None
) -> ResumableDistributedSampler | StreamPosition:
    """This rank's training order, as HF's ``train_sampling_strategy`` names it: "random" (a seeded
    permutation), "sequential" (the dataset's order) or "group_by_length" (``lengths`` grouped in
    megabatches of the global batch). A stream's order is its own (``trainer.data.stream``)."""
    if isinstance(dataset, StreamedDataset):
        return StreamPosition(dataset, num_replicas, rank, args.dataloader_num_workers)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_replicas
    return ResumableDistributedSampler(
        len(dataset),
        num_replicas,
        rank,
        seed=data_seed(args),
        shuffle=args.train_sampling_strategy != "sequential",
        lengths=lengths,
        group_size=global_batch,
    )


def train_dataloader(
    dataset: Dataset, sampler: ResumableDistributedSampler, collate_fn: Callable, args: Any, pin_memory: bool
) -> DataLoader:
    """This rank's micro-batches of one epoch, in the sampler's order: what the training loop reads
    and what ``Trainer.get_train_dataloader`` returns. ``pin_memory``: the device can use pinned
    memory (a GPU); ``args.dataloader_pin_memory`` can still turn it off."""
    workers = args.dataloader_num_workers
    return DataLoader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=workers,
        drop_last=args.dataloader_drop_last,
        # A private generator: creating the iterator must not consume the global RNG, or a
        # resumed run would draw different dropout masks than the uninterrupted one.
        generator=torch.Generator().manual_seed(args.seed),
        pin_memory=pin_memory and args.dataloader_pin_memory,
        # Options that only exist with worker processes.
        persistent_workers=workers > 0 and args.dataloader_persistent_workers,
        prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
    )


def accumulation_windows(
    dataset: Dataset, sampler: ResumableDistributedSampler, collate_fn: Callable, args: Any, pin_memory: bool
) -> Iterator[list[Batch]]:
    """Windows of ``gradient_accumulation_steps`` micro-batches; the epoch's last may be shorter.

    The loader is read one batch ahead, as accelerate's loader under HF's Trainer reads it (to know
    the last batch): a collator that draws random numbers (masked-LM masking) then draws them in
    HF's order relative to the steps' dropout. Such a collator's draws for the batch read ahead
    happen before a checkpoint and again after its resume, so a resume is exact only for collators
    that draw nothing (every collator of this project's own)."""
    if isinstance(sampler, StreamPosition):
        yield from stream_windows(sampler, collate_fn, args)
        return
    batches = iter(train_dataloader(dataset, sampler, collate_fn, args, pin_memory))
    ahead = next(batches, None)
    window: list[Batch] = []
    while ahead is not None:
        batch, ahead = ahead, next(batches, None)
        window.append(dict(batch))  # all the collator made reaches the model, as in HF's loop
        if len(window) == args.gradient_accumulation_steps:
            yield window
            window = []
    if window:
        yield window


def stream_windows(position: StreamPosition, collate_fn: Callable, args: Any) -> Iterator[list[Batch]]:
    """A stream's windows: whole ones only; once this rank's stream ends, one empty window, which
    the step's vote turns into the end of the data on every rank (a rank that stopped alone would
    leave the others waiting in a collective)."""
    rows, window = [], []
    for block in position.blocks():
        rows.append(block)
        if len(rows) == args.per_device_train_batch_size:
            window.append(dict(collate_fn(rows)))
            rows = []
            if len(window) == args.gradient_accumulation_steps:
                yield window
                window = []
    yield []


def row_length(dataset: Any) -> int:
    """A training row's tokens: a stream's block size, else the first row's length (a stream of
    samples: its first sample's)."""
    if isinstance(dataset, StreamedDataset):
        return dataset.block_size or len(next(iter(dataset))["input_ids"])
    return len(dataset[0]["input_ids"])


def epoch_at(state: Any, dataset: Any, readers: int) -> float:
    """The epoch HF logs once a step has ended: epochs done plus the share of this one read (each of
    ``readers`` ranks reads a ``1 / readers`` of the set); for a stream, which has no length,
    ``global_step / max_steps``, as HF counts a dataset without a length."""
    if isinstance(dataset, StreamedDataset):
        return state.global_step / state.max_steps
    return state.epoch_index + state.samples_into_epoch / max(len(dataset) / readers, 1)
