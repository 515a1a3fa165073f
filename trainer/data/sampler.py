"""A distributed sampler whose position is a small piece of checkpoint state.

Order: every epoch draws one permutation of ``range(dataset_len)`` from ``seed + epoch`` (the same
on every rank). The permutation is padded to a multiple of ``num_replicas`` by wrapping around to
its start, so the first ``pad = ceil(n / R) * R - n`` indices of that epoch's permutation are seen
twice (``pad <= R - 1``) and every other index exactly once. Rank ``r`` takes positions
``r, r + R, r + 2R, ...`` of the padded permutation. All ranks therefore get the same number of
samples, which DeepSpeed needs: a rank with one step fewer would hang the others in a collective.

Because ranks take interleaved positions, after each rank consumed ``start`` samples the
consumed samples are exactly the first ``start * R`` positions of the permutation. Resuming is
``set_epoch(epoch, start)``: it slices the permutation instead of replaying batches, and it also
works with a different number of ranks (see :meth:`load_state_dict`).

With ``lengths`` (HF's ``train_sampling_strategy="group_by_length"``) the epoch's permutation is
regrouped as HF's ``LengthGroupedSampler`` does: cut into megabatches of ``min(n // (4 * group), 50)``
groups (at least one), each sorted longest first, and the longest sample of all moved to the very
front (an out-of-memory error shows on the first step, not later). ``group_size`` is the global
batch, which a resume on another world size keeps, so the order stays a function of the seed and the
epoch alone; ranks still take interleaved positions, so a step's samples have similar lengths on
every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)


class ResumableDistributedSampler(Sampler[int]):
    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
        lengths: Sequence[int] | None = None,
        group_size: int = 1,
    ):
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be at least 1, got {dataset_len}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
        if lengths is not None and len(lengths) != dataset_len:
            raise ValueError(f"lengths: {len(lengths)} for a dataset of {dataset_len} samples")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.group_size = max(int(group_size), 1)
        # Samples per rank per epoch (the padded total divided evenly).
        self.num_samples = -(-dataset_len // num_replicas)
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0, position: Any = None) -> None:
        """Select the epoch, skipping the ``start`` samples this rank already consumed in it (a
        map-style position is all in those two numbers; a stream's ``position`` is not)."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}] (samples per rank), got {start}")
        self.epoch = epoch
        self.start = start

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The padded order of one epoch, shared by all ranks."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=gen)
            if self.lengths is not None:
                order = length_grouped(order, self.lengths, self.group_size)
        else:
            order = torch.arange(self.dataset_len)
        total = self.num_samples * self.num_replicas
        # Wrap around (repeatedly, when there are fewer samples than ranks) up to the padded size.
        return order.repeat(-(-total // self.dataset_len))[:total]

    def __iter__(self) -> Iterator[int]:
        first = self.rank + self.start * self.num_replicas
        return iter(self.permutation()[first :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "start": self.start,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`, possibly on a different number of ranks.

        With the same number of ranks the position is exact. With a different number, the
        ``start * old_ranks`` consumed positions are re-divided among the new ranks, rounding
        down, so at most ``new_ranks - 1`` samples are seen again and none are skipped.
        """
        self.seed = int(state["seed"])
        start = int(state["start"])
        old = int(state.get("num_replicas", self.num_replicas))
        if old != self.num_replicas:
            consumed = start * old
            start = min(consumed // self.num_replicas, self.num_samples)
            logger.warning(
                "sampler resumed on %d ranks (saved on %d): %d of %d consumed samples are repeated",
                self.num_replicas, old, consumed - start * self.num_replicas, consumed,
            )  # fmt: skip
        self.set_epoch(int(state["epoch"]), start)


def length_grouped(order: torch.Tensor, lengths: Sequence[int], group_size: int) -> torch.Tensor:
    """``order`` regrouped by length as HF's ``LengthGroupedSampler`` does (see the module's docstring)."""
    megabatch = max(min(len(lengths) // (group_size * 4), 50), 1) * group_size
    indices = order.tolist()
    groups = [
        sorted(indices[i : i + megabatch], key=lambda j: lengths[j], reverse=True)
        for i in range(0, len(indices), megabatch)
    ]
    longest = max(range(len(groups)), key=lambda g: lengths[groups[g][0]])  # the first of equals
    groups[0][0], groups[longest][0] = groups[longest][0], groups[0][0]
    return torch.tensor([i for group in groups for i in group], dtype=torch.long)
