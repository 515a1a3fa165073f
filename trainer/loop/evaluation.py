"""HF's evaluation loop over an Engine: what ``Trainer.evaluate`` and ``Trainer.predict`` run.

Each rank forwards its own share of the dataset (``eval_batches``, over ``eval_dataloader``); shards
are padded with rows that count for nothing so every rank runs the same number of forwards, which
ZeRO-3 and the pipeline need. The loss is the objective's: a causal LM's is the sum of every target
token's loss over the number of target tokens on all ranks (token-weighted, as the training loss; HF
averages per-batch means instead), any other model's the mean of its batch losses weighted by their
rows, as HF's (each batch alike under ``Seq2SeqTrainer``, as HF's). A set without labels
(``label_names``) has no loss, as HF's.

With predictions, each batch's outputs (and labels) go through ``preprocess_logits_for_metrics`` on
the rank that computed them, before anything is gathered: only what it returns travels, so an
``argmax`` gathers ``[n, seq]`` ids, not the eval set's ``[n, seq, vocab]`` logits on every rank.
Predictions, labels and inputs of any structure come back in dataset order on every rank, padded
with -100 as HF's (``trainer.loop.predictions``). ``compute_metrics`` gets HF's ``EvalPrediction`` and
runs on every rank, as HF's does: once over the set, or after every batch (``batch_eval_metrics``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize, speed_metrics

from trainer.engine import Batch, Engine
from trainer.loop.predictions import Nested, Part, RowStore, gather, select_rows, to_numpy, to_tensors
from trainer.runtime.distributed import all_reduce_sum

T = TypeVar("T")


@dataclass(frozen=True)
class Predictions:
    """What the loop gathers besides the loss and what it does with it: HF's Trainer hooks and
    evaluation arguments. ``returned``: the predictions come back (``predict``; ``evaluate`` unless
    ``batch_eval_metrics``, whose point is never holding them all)."""

    preprocess: Callable[[Any, Any], Any] | None = None  # preprocess_logits_for_metrics
    compute_metrics: Callable[..., Any] | None = None
    include: tuple[str, ...] = ()  # include_for_metrics: "inputs", "loss"
    accumulation_steps: int | None = None  # eval_accumulation_steps
    per_batch: bool = False  # batch_eval_metrics
    returned: bool = True
    ignore_keys: tuple[str, ...] | None = None  # None: the model config's keys_to_ignore_at_inference
    # predict_with_generate: a batch's (generated ids, its labels padded alike) in place of its logits
    generate: Callable[[Batch], tuple[torch.Tensor, torch.Tensor | None]] | None = None

    @classmethod
    def from_args(
        cls,
        args: Any,
        preprocess: Callable[[Any, Any], Any] | None,
        compute_metrics: Callable[..., Any] | None,
        ignore_keys: list[str] | None = None,
        returned: bool = True,
        generate: Callable[[Batch], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> Predictions:
        return cls(
            preprocess,
            compute_metrics,
            tuple(args.include_for_metrics),
            args.eval_accumulation_steps,
            args.batch_eval_metrics,
            returned,
            None if ignore_keys is None else tuple(ignore_keys),
            generate,
        )


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
    dataset: Any, collator: Callable, batch_size: int, rank: int, world_size: int, drop_last: bool = False
) -> Iterator[tuple[Batch, list[int]]]:
    """This rank's share of ``dataset`` as (batch, dataset indices); -1 marks a padding row (a copy
    of row 0), which ``_forward`` keeps out of the loss and the predictions. Every row is
    evaluated, unless ``drop_last`` (HF's ``dataloader_drop_last``) leaves out each rank's last
    batch when it is short, as HF's evaluation does. Shards are of equal length, so every rank
    runs the same number of batches either way."""
    loader = eval_dataloader(dataset, collator, batch_size, rank, world_size, drop_last=drop_last)
    indices = loader.dataset.indices
    for start, batch in zip(range(0, len(loader) * batch_size, batch_size), loader, strict=True):
        batch = dict(batch)  # all the collator made reaches the model, as in HF's loop
        yield batch, indices[start : start + batch_size]


def evaluation_loop(
    engine: Engine,
    batches: Iterable[tuple[Batch, list[int]]],
    num_samples: int,
    metric_key_prefix: str = "eval",
    predictions: Predictions | None = None,
    collectives: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> EvalLoopOutput:
    """Loss (and, with ``predictions``, predictions, labels and metrics) of ``batches`` on every
    rank; the metrics are prefixed with ``metric_key_prefix``. ``collectives`` wraps the gathers
    and reductions (the Trainer's watchdog phase)."""
    store, metrics = RowStore(), None
    totals = torch.zeros(3, device=engine.device)  # summed loss, its count, labelled batches
    engine.train(False)
    try:
        for step, ((batch, indices), last) in enumerate(_with_last(batches)):
            part, sums = _forward(engine, batch, indices, predictions)
            totals += sums
            if predictions is None:
                continue
            if predictions.per_batch:  # HF's batch_eval_metrics: this step's rows of all ranks
                with collectives():
                    rows = gather([to_numpy(part)] if len(part["index"]) else [])
                metrics = _batch_metrics(predictions, rows, last, engine.device)
            if predictions.returned:
                store.add(part)
            if predictions.accumulation_steps and (step + 1) % predictions.accumulation_steps == 0:
                store.to_host()
    finally:
        engine.train(True)
    with collectives():
        loss_sum, count, labelled = all_reduce_sum(totals).tolist()
        rows = store.gather() if predictions is not None and predictions.returned else {}
        measured = engine.objective.metric_means(engine.device, evaluation=True)  # TRL's eval_rewards/...
    preds, labels = rows.get("predictions"), rows.get("label_ids")
    if predictions is not None and not predictions.per_batch:
        metrics = _set_metrics(predictions, rows)
    metrics = {**denumpify_detensorize(metrics or {}), **measured}
    if labelled:
        metrics["loss"] = loss_sum / max(count, 1.0)
    prefix = f"{metric_key_prefix}_"
    metrics = {k if k.startswith(prefix) else prefix + k: v for k, v in metrics.items()}
    return EvalLoopOutput(preds, labels, metrics, num_samples)


@torch.no_grad()
def _forward(
    engine: Engine, batch: Batch, indices: list[int], predictions: Predictions | None
) -> tuple[Part, torch.Tensor]:
    """(this batch's rows to keep, [summed loss, its count, 1 if labelled] on the device)."""
    objective = engine.objective
    labelled = objective.labelled(batch)
    batch, rows = objective.eval_rows(batch, indices)
    loss, count, outputs = engine.eval_step(batch, outputs=predictions is not None)
    # A batch of padding alone counts nothing, nor do a tensor-parallel group's ranks but its first
    # (they hold the same rows).
    counted = [i >= 0 and engine.mesh.counts_rows for i in rows]
    weight = 1.0 if any(counted) else 0.0
    # In the loss's own fp32, summed batch by batch as training sums its windows.
    sums = torch.stack([loss.float(), count.float(), count.new_tensor(float(labelled)).float()]) * weight
    if predictions is None:
        return {}, sums
    keep = torch.tensor(counted)
    targets = _labels(batch, objective.label_names, engine.device) if labelled else None
    if predictions.generate is not None:
        logits, padded = predictions.generate(batch)
        targets = padded if targets is not None else None
    else:
        logits = _logits(outputs, engine.module, predictions.ignore_keys)
    kept = predictions.preprocess(logits, targets) if predictions.preprocess is not None else logits
    part: Part = {"index": np.array(rows)[keep.numpy()], "predictions": select_rows(kept, keep)}
    if targets is not None:
        part["label_ids"] = select_rows(targets, keep)
    if "inputs" in predictions.include:
        main_input = getattr(engine.module, "main_input_name", "input_ids")
        part["inputs"] = select_rows(batch[main_input], keep)
    if "loss" in predictions.include and labelled:  # HF's: each row carries its batch's mean loss
        part["losses"] = objective.batch_mean(batch, outputs, loss, count).expand(int(keep.sum()))
    return part, sums


def _labels(batch: Batch, names: tuple[str, ...], device: torch.device) -> Nested:
    """HF's labels of a batch: the one label tensor, or a tuple of them in ``label_names`` order."""
    values = tuple(batch[name].to(device) for name in names)
    return values[0] if len(values) == 1 else values


def _logits(outputs: Any, model: torch.nn.Module, ignore_keys: tuple[str, ...] | None) -> Nested:
    """HF's predictions of a forward (its ``prediction_step``): every output but the loss and
    ``ignore_keys`` (default: the keys the model's config ignores at inference, else a cache); a
    single one as itself, several as a tuple. A tuple output's loss (a scalar) leads it, as HF's."""
    if ignore_keys is None:
        config = getattr(model, "config", None)
        ignore_keys = (
            () if config is None else tuple(getattr(config, "keys_to_ignore_at_inference", ["cache"]))
        )
    if isinstance(outputs, Mapping):
        skip = {*ignore_keys, "loss"}
        values = tuple(v for k, v in outputs.items() if k not in skip and v is not None)
    else:
        values = tuple(outputs)
        if values and isinstance(values[0], torch.Tensor) and values[0].dim() == 0:
            values = values[1:]
    return values[0] if len(values) == 1 else values


def _set_metrics(predictions: Predictions, rows: dict[str, Nested]) -> Any:
    """``compute_metrics`` over the whole set, where there are predictions and labels (as HF's)."""
    preds, labels = rows.get("predictions"), rows.get("label_ids")
    if predictions.compute_metrics is None or preds is None or labels is None:
        return None
    inputs, losses = rows.get("inputs"), rows.get("losses")
    return predictions.compute_metrics(EvalPrediction(preds, labels, inputs=inputs, losses=losses))


def _batch_metrics(
    predictions: Predictions, rows: dict[str, Nested], last: bool, device: torch.device
) -> Any:
    """HF's ``batch_eval_metrics``: ``compute_metrics(EvalPrediction, compute_result=last)`` on one
    step's rows of all ranks, as tensors on the device (as HF's); None where it is not called."""
    preds, labels = rows.get("predictions"), rows.get("label_ids")
    if predictions.compute_metrics is None or preds is None or labels is None:
        return None
    inputs, losses = rows.get("inputs"), rows.get("losses")
    prediction = EvalPrediction(
        to_tensors(preds, device),
        to_tensors(labels, device),
        inputs=None if inputs is None else to_tensors(inputs, device),
        losses=None if losses is None else to_tensors(losses, device),
    )
    return predictions.compute_metrics(prediction, compute_result=last)


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last (the step whose batch metrics compute the result)."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def evaluate_set(
    trainer: Any,
    dataset: Any,
    prefix: str,
    with_predictions: bool,
    ignore_keys: list[str] | None = None,
    returned: bool = True,
) -> EvalLoopOutput:
    """``evaluate``'s and ``predict``'s loop over ``dataset`` on the trainer's engine: each rank's
    padded shard, the loss, with ``with_predictions`` the predictions (the trainer's ``generation()``
    in place of the logits where it has one) and metrics, and HF's speed metrics."""
    args, (world, rank) = trainer.args, trainer.mesh.data_ranks
    start, bs = time.time(), args.per_device_eval_batch_size
    hooks = (trainer.preprocess_logits_for_metrics, trainer.compute_metrics, ignore_keys, returned)
    output = evaluation_loop(
        trainer.engine,
        eval_batches(dataset, trainer.data_collator, bs, rank, world, args.dataloader_drop_last),
        len(dataset),
        prefix,
        Predictions.from_args(args, *hooks, trainer.generation()) if with_predictions else None,
        collectives=lambda: trainer.watchdog.phase("eval"),
    )
    shard = math.ceil(len(dataset) / world)  # each rank's rows, padding included
    steps = shard // bs if args.dataloader_drop_last else math.ceil(shard / bs)
    output.metrics.update(speed_metrics(prefix, start, num_samples=len(dataset), num_steps=steps))
    return output
