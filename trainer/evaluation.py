"""HF's evaluation loop over an Engine: what ``Trainer.evaluate`` and ``Trainer.predict`` run.

Each rank forwards its own share of the dataset (``eval_batches``, over ``eval_dataloader``);
shards are padded with fully masked rows so every rank runs the same number of forwards, which
ZeRO-3 and the pipeline need. The loss is the sum of every target token's loss over the number of
target tokens, reduced over ranks (token-weighted, as the training loss; HF averages per-batch
means instead).

With predictions, each batch's logits (and labels) go through ``preprocess_logits_for_metrics`` on
the rank that computed them, before anything is gathered: only what it returns travels, so an
``argmax`` gathers ``[n, seq]`` ids, not the eval set's ``[n, seq, vocab]`` logits on every rank.
Rows come back in dataset order, on every rank; rows of different lengths are padded with -100, as
HF's are. ``compute_metrics`` gets HF's ``EvalPrediction`` and runs on every rank, as HF's does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from trainer.data import IGNORE_INDEX, MODEL_INPUTS, pad_stack
from trainer.distributed import all_gather_object, all_reduce_sum
from trainer.engine import Batch, Engine, count_targets

PAD_INDEX = -100  # HF's padding of predictions and labels of different lengths
Row = tuple[int, Any, np.ndarray]  # (dataset index, this sample's predictions, its labels)


class EvalShard(Dataset):
    """This rank's share of an evaluation set: rows ``rank, rank + world_size, ...``, padded to
    ``ceil(n / world_size)`` rows with copies of row 0 (index -1), so every rank runs as many
    forwards. Items are (dataset index, row)."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset = dataset
        n = len(dataset)
        self.indices = list(range(rank, n, world_size))
        self.indices += [-1] * (math.ceil(n / world_size) - len(self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[int, Any]:
        i = self.indices[j]
        return i, self.dataset[i if i >= 0 else 0]


class MaskPaddingRows:
    """The Trainer's collator over ``EvalShard`` items: a padding row's labels are all masked, so
    it adds nothing to the loss (a class, not a closure, so worker processes can pickle it)."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, items: list[tuple[int, Any]]) -> Batch:
        batch = self.collator([row for _, row in items])
        pad_rows = torch.tensor([i < 0 for i, _ in items])
        if "labels" in batch and pad_rows.any():
            labels = batch["labels"]
            batch["labels"] = labels.masked_fill(pad_rows.view(-1, *[1] * (labels.dim() - 1)), IGNORE_INDEX)
        return batch


def eval_dataloader(
    dataset: Any,
    collator: Callable,
    batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    drop_last: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """This rank's evaluation batches (``EvalShard`` order, padding rows masked): what
    ``eval_batches`` reads, and ``Trainer.get_eval_dataloader``/``get_test_dataloader`` return."""
    return DataLoader(
        EvalShard(dataset, rank, world_size),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=MaskPaddingRows(collator),
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=num_workers > 0 and persistent_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def eval_batches(
    dataset: Any, collator: Callable, batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[Batch, list[int]]]:
    """This rank's share of ``dataset`` as (batch, dataset indices); -1 marks a padding row, whose
    labels are all masked so it adds nothing to the loss. Every row is evaluated (no drop_last)."""
    loader = eval_dataloader(dataset, collator, batch_size, rank, world_size)
    indices = loader.dataset.indices
    for start, batch in zip(range(0, len(indices), batch_size), loader, strict=True):
        batch = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
        yield batch, indices[start : start + batch_size]


def evaluation_loop(
    engine: Engine,
    batches: Iterable[tuple[Batch, list[int]]],
    num_samples: int,
    metric_key_prefix: str = "eval",
    with_predictions: bool = False,
    preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    compute_metrics: Callable[[EvalPrediction], dict[str, Any]] | None = None,
    collectives: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> EvalLoopOutput:
    """Loss (and, ``with_predictions``, predictions and labels) of ``batches`` on every rank; the
    metrics are prefixed with ``metric_key_prefix``. ``collectives`` wraps the closing reductions
    (the Trainer's watchdog phase)."""
    sums, rows = _forward(engine, batches, with_predictions, preprocess_logits_for_metrics)
    with collectives():
        loss_sum, targets = all_reduce_sum(sums).tolist()
        parts = all_gather_object(rows) if with_predictions else []
    predictions = label_ids = None
    if with_predictions:
        merged = sorted((row for part in parts for row in part), key=lambda row: row[0])
        predictions = _stack([row[1] for row in merged])
        label_ids = _stack([row[2] for row in merged])
    metrics: dict[str, Any] = {}
    if compute_metrics is not None and with_predictions:
        metrics = denumpify_detensorize(compute_metrics(EvalPrediction(predictions, label_ids)))
    loss = loss_sum / max(targets, 1.0)
    metrics["loss"] = loss
    prefix = f"{metric_key_prefix}_"
    metrics = {k if k.startswith(prefix) else prefix + k: v for k, v in metrics.items()}
    return EvalLoopOutput(predictions, label_ids, metrics, num_samples)


@torch.no_grad()
def _forward(
    engine: Engine,
    batches: Iterable[tuple[Batch, list[int]]],
    with_predictions: bool,
    preprocess: Callable[[torch.Tensor, torch.Tensor], Any] | None,
) -> tuple[torch.Tensor, list[Row]]:
    """([summed loss, target tokens] of this rank on the device, this rank's prediction rows)."""
    # In the loss's own fp32, summed batch by batch as training sums its windows.
    sums = torch.zeros(2, device=engine.device)
    rows: list[Row] = []
    engine.train(False)
    try:
        for batch, indices in batches:
            if not with_predictions:
                loss, count = engine.eval_loss_sum(batch)
                sums += torch.stack([loss, count])
                continue
            logits = engine.logits(batch)
            labels = batch["labels"].to(logits.device)
            sums[0] += engine.loss_fn(logits, labels)
            sums[1] += count_targets(batch)
            kept = preprocess(logits, labels) if preprocess is not None else logits
            kept, host_labels = _numpy(kept), batch["labels"].numpy()
            rows += [(i, _take(kept, j), host_labels[j]) for j, i in enumerate(indices) if i >= 0]
    finally:
        engine.train(True)
    return sums, rows


def _numpy(value: Any) -> Any:
    """Tensors (or tuples of them) to host arrays; bf16, which numpy lacks, as fp32 (as HF)."""
    if isinstance(value, tuple | list):
        return type(value)(_numpy(v) for v in value)
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return (value.float() if value.dtype == torch.bfloat16 else value).cpu().numpy()
    return np.asarray(value)


def _take(value: Any, j: int) -> Any:
    if isinstance(value, tuple | list):
        return tuple(_take(v, j) for v in value)
    return value[j]


def _stack(items: list[Any]) -> Any:
    """One array of per-sample arrays, padded on the right with -100; tuples element by element."""
    if items and isinstance(items[0], tuple):
        return tuple(_stack([item[k] for item in items]) for k in range(len(items[0])))
    if items and np.ndim(items[0]) == 0:
        return np.stack(items)
    return pad_stack(items, PAD_INDEX)


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")
