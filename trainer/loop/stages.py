"""The named stages of a step, before the objective counts its data.

A step reads, top to bottom: a producer gives the step's window of micro-batches (``Producer``: by
default ``LoaderProducer``, the data loader's; a producer may instead generate rollouts with the
policy and score them), the objective counts it and the ranks vote, then each micro-batch's summed
loss goes backward and the optimizer steps (``Trainer._train_epoch``).

Before the first step, the Trainer's ``stages`` (``DataStage``) prepare its training and evaluation
sets in order: a reference's log-probabilities (``trainer.loop.reference``), KTO's KL partners. They
run again on any set evaluated later. A Trainer subclass or a feature extends the loop by adding a
stage or setting the producer, not by overriding the loop's methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from trainer.data.loader import accumulation_windows

Window = list[dict[str, Any]]


class DataStage:
    """A stage of the data before the objective counts it: run on the training and evaluation sets
    before the first step (``prepare``, in the Trainer's ``stages`` order), then told training starts
    (``started``); and run on any set evaluated later."""

    def prepare(self, trainer: Any, dataset: Any, name: str | None) -> Any:
        """``dataset`` as the next stage (or the objective) reads it. ``name``: the Trainer's own set
        ("train", "eval"), or None for a set one ``evaluate`` call passes."""
        return dataset

    def started(self, trainer: Any) -> None:
        """Training starts: what the stage held for preparing sets may go."""


def prepared(trainer: Any, dataset: Any, name: str | None) -> Any:
    """``dataset`` through the trainer's stages, in order (its engine is built)."""
    for stage in trainer.stages:
        dataset = stage.prepare(trainer, dataset, name)
    return dataset


class Producer(Protocol):
    def windows(self, trainer: Any, sampler: Any) -> Iterator[Window]:
        """Each step's micro-batches, from ``sampler``'s position on (the epoch's rows on this rank)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this rank's producer beyond the run's position (a rollout
        buffer in use); tensors, numbers and lists only."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave, from the checkpoint resumed."""


class LoaderProducer:
    """The default producer: the data loader's accumulation windows over the training set (its
    position is the run's: nothing of its own to keep)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def windows(self, trainer: Any, sampler: Any) -> Iterator[Window]:
        return accumulation_windows(
            trainer.train_dataset,
            sampler,
            trainer.data_collator,
            trainer.args,
            pin_memory=trainer.hardware.device == "cuda",
        )
