"""The run's parallel layout, in the spirit of torchtitan's ``ParallelDims``: how the world's ranks
split into data, tensor, pipeline and sequence parallel groups, and where this rank sits. The one
place the data-parallel size is computed; everything else asks a ``ParallelLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """``world = data × tensor × pipeline × sequence``; ``data`` is derived. A sequence-parallel
    group is consecutive ranks, as DeepSpeed's Ulysses groups them, and so is a tensor-parallel one,
    as AutoTP's (data, tensor) mesh groups them; the two do not run together."""

    world: int
    rank: int = 0
    tensor: int = 1
    pipeline: int = 1
    sequence: int = 1

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError([("world_size", f"must be at least 1, got {self.world}")])
        if not 0 <= self.rank < self.world:
            raise ConfigError([("rank", f"{self.rank} is not a rank of a world of {self.world}")])
        for name, size in (("tensor", self.tensor), ("pipeline", self.pipeline), ("sequence", self.sequence)):
            if size < 1:
                raise ConfigError([(f"{name}_parallel_size", f"must be at least 1, got {size}")])
        if self.world % (self.tensor * self.pipeline * self.sequence):
            sizes = f"{self.tensor} × {self.pipeline} × {self.sequence}"
            raise ConfigError(
                [
                    (
                        "tensor_parallel_size, pipeline_parallel_size, sequence_parallel_size",
                        f"world size {self.world} is not divisible by tensor × pipeline × sequence = {sizes}",
                    )
                ]
            )

    @property
    def data(self) -> int:
        """The data-parallel size: the replicas a global batch is split over (DeepSpeed's
        ``dp_world_size``, what ``train_batch_size`` counts)."""
        return self.world // (self.tensor * self.pipeline * self.sequence)

    @property
    def sharing(self) -> int:
        """The consecutive ranks that read the same rows: a sequence- or tensor-parallel group."""
        return self.sequence * self.tensor

    @property
    def readers(self) -> int:
        """How many ranks read rows of their own: one per sequence- or tensor-parallel group (its
        ranks share rows). A pipeline's stages each read their own micro-batches and pool them."""
        return self.world // self.sharing

    @property
    def reader_rank(self) -> int:
        """This rank's index among the readers."""
        return self.rank // self.sharing

    @property
    def counts_rows(self) -> bool:
        """Whether this rank's rows count in a sum over all ranks: a tensor-parallel group's ranks
        hold the same rows, and only its first counts them (a sequence-parallel group's ranks hold
        slices of them, and each counts its own)."""
        return self.rank % self.tensor == 0

    @property
    def sequence_rank(self) -> int:
        return self.rank % self.sequence

    @property
    def data_ranks(self) -> tuple[int, int]:
        """(readers, this rank's index among them): what the samplers shard by."""
        return self.readers, self.reader_rank
