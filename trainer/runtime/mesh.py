"""The run's mesh, in the spirit of torchtitan's ``ParallelDims``: how the world's processes split
into data, tensor, pipeline, sequence and expert parallel groups, where this rank sits, and the
process groups once the engine has made them.

It is built once, in the run's plan (``mesh_for``: the arguments and the DeepSpeed file together, as
``resolve`` settles them), and handed to whatever needs a size: the engine, the samplers,
evaluation, the checkpoint manifest and resume, the model card, NEFTune, auto-batch. Nothing else
reads a parallel size from the arguments, the DeepSpeed dict or DeepSpeed
(``tests/unit/test_mesh_source.py`` checks that from the source). A checkpoint's manifest records
the mesh it was cut for (``manifest_sizes``), and ``saved_mesh`` reads it back.

Names: ``world_size`` is processes; ``data_parallel_size`` the replicas a global batch is split over;
``readers`` the ranks that read rows of their own; ``zero_shards`` the ranks ZeRO shards over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from trainer.config import ConfigError, parallel_sizes

DIMENSIONS = ("tensor", "pipeline", "sequence", "expert")


@dataclass(frozen=True)
class Mesh:
    """``world_size = data × tensor × pipeline × sequence``; the data-parallel size is derived.
    Experts split the data-parallel ranks (``expert`` divides it), as DeepSpeed's expert groups do.
    A sequence-parallel group is consecutive ranks, as DeepSpeed's Ulysses groups them, and so is a
    tensor-parallel one, as AutoTP's (data, tensor) mesh groups them; the two do not run together.
    ``groups``: the engine's process groups by dimension, once made (``with_groups``)."""

    world_size: int
    rank: int = 0
    tensor: int = 1
    pipeline: int = 1
    sequence: int = 1
    expert: int = 1
    groups: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # Derived in __post_init__ (plain attributes: a step reads them without a call).
    #: The replicas a global batch is split over (DeepSpeed's ``dp_world_size``, what
    #: ``train_batch_size`` counts).
    data_parallel_size: int = field(init=False, repr=False, compare=False)
    #: The ranks ZeRO shards parameters, gradients and optimizer states over: the data-parallel ranks
    #: and, under sequence parallelism, every rank of their groups (DeepSpeed's ``seq_dp_world_size``).
    #: What a checkpoint's optimizer shards are cut for.
    zero_shards: int = field(init=False, repr=False, compare=False)
    #: The consecutive ranks that read the same rows: a sequence- or tensor-parallel group.
    sharing: int = field(init=False, repr=False, compare=False)
    #: How many ranks read rows of their own: one per sequence- or tensor-parallel group (its ranks
    #: share rows). A pipeline's stages each read their own micro-batches and pool them.
    readers: int = field(init=False, repr=False, compare=False)
    #: This rank's index among the readers.
    reader_rank: int = field(init=False, repr=False, compare=False)
    #: (readers, this rank's index among them): what the samplers shard by.
    data_ranks: tuple[int, int] = field(init=False, repr=False, compare=False)
    #: Whether this rank's rows count in a sum over all ranks: a tensor-parallel group's ranks hold
    #: the same rows, and only its first counts them (a sequence-parallel group's ranks hold slices
    #: of them, and each counts its own).
    counts_rows: bool = field(init=False, repr=False, compare=False)
    sequence_rank: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError([("world_size", f"must be at least 1, got {self.world_size}")])
        if not 0 <= self.rank < self.world_size:
            raise ConfigError([("rank", f"{self.rank} is not a rank of a world of {self.world_size}")])
        for name in DIMENSIONS:
            if getattr(self, name) < 1:
                raise ConfigError(
                    [(f"{name}_parallel_size", f"must be at least 1, got {getattr(self, name)}")]
                )
        if self.world_size % (self.tensor * self.pipeline * self.sequence):
            sizes = f"{self.tensor} × {self.pipeline} × {self.sequence}"
            keys = "tensor_parallel_size, pipeline_parallel_size, sequence_parallel_size"
            raise ConfigError(
                [
                    (
                        keys,
                        f"world size {self.world_size} is not divisible by tensor × pipeline × sequence = {sizes}",
                    )
                ]
            )
        sharing = self.sequence * self.tensor
        derived = {
            "data_parallel_size": self.world_size // (self.tensor * self.pipeline * self.sequence),
            "sharing": sharing,
            "readers": self.world_size // sharing,
            "reader_rank": self.rank // sharing,
            "counts_rows": self.rank % self.tensor == 0,
            "sequence_rank": self.rank % self.sequence,
        }
        derived["zero_shards"] = derived["data_parallel_size"] * self.sequence
        derived["data_ranks"] = (derived["readers"], derived["reader_rank"])
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        if self.data_parallel_size % self.expert:
            raise ConfigError(
                [
                    (
                        "expert_parallel_size",
                        f"{self.expert} does not divide the {self.data_parallel_size} data-parallel ranks",
                    )
                ]
            )

    def with_groups(self, **groups: Any) -> Mesh:
        """This mesh with the process groups the engine made (by dimension name) recorded."""
        unknown = set(groups) - set(DIMENSIONS) - {"data"}
        if unknown:
            raise ValueError(f"no mesh dimension named {', '.join(sorted(unknown))}")
        return replace(self, groups={**self.groups, **groups})

    def manifest_sizes(self) -> dict[str, int]:
        """What a checkpoint's manifest records of the mesh it was cut for."""
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "optimizer_partitions": self.zero_shards,
            "tensor_parallel_size": self.tensor,
            "pipeline_parallel_size": self.pipeline,
            "sequence_parallel_size": self.sequence,
            "expert_parallel_size": self.expert,
        }


@dataclass(frozen=True)
class Sizes:
    """What a run's mesh is built from, before a world is known: the door checks a model against
    these (its heads against the splits) before any process group exists."""

    tensor: int = 1
    pipeline: int = 1
    sequence: int = 1
    expert: int = 1


def sizes_for(run: Any) -> Sizes:
    """The pipeline, sequence, tensor and expert sizes as the DeepSpeed dict will have them: an argument set,
    else the DeepSpeed file's, else the default (``config.parallel_sizes``, the rule ``resolve``
    follows). ``run``: a RunConfig or its training arguments."""
    pipeline, sequence, tensor, expert = parallel_sizes(run)
    return Sizes(tensor=tensor, pipeline=pipeline, sequence=sequence, expert=expert)


def mesh_for(run: Any, world_size: int, rank: int) -> Mesh:
    """This process's mesh: the world and rank from the process group, the sizes ``sizes_for`` gives."""
    return Mesh(world_size, rank, **asdict(sizes_for(run)))


@dataclass(frozen=True)
class SavedMesh:
    """The sizes a checkpoint was cut for, as its manifest records them (``Mesh.manifest_sizes``).
    Older manifests lack some: their data-parallel size was the world, and their optimizer shards
    were counted by the data-parallel size."""

    world_size: int | None
    data_parallel_size: int | None
    zero_shards: int | None
    tensor: int
    pipeline: int
    expert: int = 1


def saved_mesh(manifest: Mapping[str, Any]) -> SavedMesh:
    """The mesh a checkpoint's manifest records."""
    data = manifest.get("data_parallel_size", manifest.get("world_size"))
    return SavedMesh(
        manifest.get("world_size"),
        data,
        manifest.get("optimizer_partitions", data),
        manifest.get("tensor_parallel_size", 1),
        manifest.get("pipeline_parallel_size", 1),
        manifest.get("expert_parallel_size", 1),
    )
