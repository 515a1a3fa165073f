"""HF's evaluation loop over an Engine: what ``Trainer.evaluate`` and ``Trainer.predict`` run.

Each rank forwards its own share of the dataset (``eval_batches``, over ``eval_dataloader``); shards
are padded with copies of row 0, kept out of the loss and the predictions, so every rank runs the
same number of forwards, which ZeRO-3 and the pipeline need. The loss is the sum of every target
token's loss over the number of target tokens, reduced over ranks (token-weighted, as the training
loss; HF averages per-batch means instead).

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
from trainer.engine import Batch, Engine

PAD_INDEX = -100  # HF's padding of predictions and labels of different lengths
Row = tuple[int, Any, np.ndarray]  # (dataset index, this sample's predictions, its labels)


class EvalShard(Dataset):
    """This rank's share of an evaluation set: rows ``rank, rank + world_size, ...``, padded to
    ``ceil(n / world_size)`` rows with copies of row 0, so every rank runs as many forwards.
    ``indices`` holds each item's dataset index, -1 for a padding row."""

    def __init__(self, dataset: Any, rank: int, world_size: int):
        self.dataset = dataset
        n = len(dataset)
        self.indices = list(range(rank, n, world_size))
        self.indices += [-1] * (math.ceil(n / world_size) - len(self.indices))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> Any:
        i = self.indices[j]
        return self.dataset[i if i >= 0 else 0]


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
    """This rank's evaluation batches, in ``EvalShard`` order: what ``eval_batches`` reads, and
    ``Trainer.get_eval_dataloader``/``get_test_dataloader`` return."""
    return DataLoader(
        EvalShard(dataset, rank, world_size),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collator,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        persistent_workers=num_workers > 0 and persistent_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


def eval_batches(
    dataset: Any, collator: Callable, batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[Batch, list[int]]]:
    """This rank's share of ``dataset`` as (batch, dataset indices); -1 marks a padding row (a copy
    of row 0), which ``_forward`` keeps out of the loss and the predictions. Every row is
    evaluated (no drop_last)."""
    loader = eval_dataloader(dataset, collator, batch_size, rank, world_size)
    indices = loader.dataset.indices
    for start, batch in zip(range(0, len(indices), batch_size), loader, strict=True):
        batch = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
        yield batch, indices[start : start + batch_size]


def without_padding_rows(batch: Batch, indices: list[int], token_exact: bool) -> tuple[Batch, float]:
    """(the batch to forward, the weight of its loss). Ranks run the same number of forwards
    (ZeRO-3 and the pipeline need it), so a shard that ran out forwards padding rows. A token-exact
    causal loss masks their labels, keeping every rank's shapes; a model's own loss is a mean that
    cannot leave rows out, so they are cut, and a batch of padding alone counts for nothing."""
    real = torch.tensor([i >= 0 for i in indices])
    if bool(real.all()):
        return batch, 1.0
    if token_exact:
        return {**batch, "labels": batch["labels"].masked_fill(~real[:, None], IGNORE_INDEX)}, 1.0
    if not bool(real.any()):
        return {k: v[:1] if torch.is_tensor(v) else v for k, v in batch.items()}, 0.0
    rows = len(indices)
    return {k: v[real] if torch.is_tensor(v) and len(v) == rows else v for k, v in batch.items()}, 1.0


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
    """([summed loss, its count] of this rank on the device, this rank's prediction rows)."""
    # In the loss's own fp32, summed batch by batch as training sums its windows.
    sums = torch.zeros(2, device=engine.device)
    rows: list[Row] = []
    token_exact = engine.objective.token_exact_causal
    engine.train(False)
    try:
        for batch, indices in batches:
            batch, weight = without_padding_rows(batch, indices, token_exact)
            loss, count, outputs = engine.eval_step(batch, outputs=with_predictions)
            sums += torch.stack([loss.float(), count.float()]) * weight
            if not with_predictions:
                continue
            logits = _logits(outputs, engine.module)
            labels = batch["labels"].to(engine.device)
            kept = preprocess(logits, labels) if preprocess is not None else logits
            kept, host_labels = _numpy(kept), batch["labels"].numpy()
            real = [i for i in indices if i >= 0] if weight else []
            rows += [(i, _take(kept, j), host_labels[j]) for j, i in enumerate(real)]
    finally:
        engine.train(True)
    return sums, rows


def _logits(outputs: Any, model: torch.nn.Module) -> Any:
    """HF's predictions of a forward: every output but the loss and the keys the model's config
    ignores at inference (HF's default: a cache); a single one as itself, several as a tuple."""
    ignore = set(getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", ["cache"]))
    if isinstance(outputs, dict):
        values = tuple(v for k, v in outputs.items() if k not in ignore | {"loss"})
    else:
        values = tuple(outputs)
    return values[0] if len(values) == 1 else values


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
