"""The parallel sizes a run's DeepSpeed dict will hold, as ``resolve`` settles them (what its
``Mesh`` is built from), whether the dict gives AutoTP sharding rules of its own, and the
dict ``zero.Init`` is given under AutoTP."""

from __future__ import annotations

from typing import Any

from trainer.config.arguments import RunArgs, TrainingArgs
from trainer.config.errors import ConfigError
from trainer.config.files import MISSING, base_config, get_path, positive_int


def parallel_sizes(run: RunArgs | TrainingArgs) -> tuple[int, int, int, int]:
    """(pipeline stages, sequence-, tensor- and expert-parallel sizes) as ``resolve`` settles them: an argument set
    explicitly (or above 1), else the DeepSpeed file's value, else the argument's default. What a
    run's ``Mesh`` is built from (``runtime.mesh.sizes_for``), so the mesh and the DeepSpeed dict agree."""
    args = run.training if hasattr(run, "training") else run
    try:
        data = base_config(args)[0]
    except ConfigError:  # a file that does not load: resolve reports it, with the arguments' sizes here
        data = {}
    sizes = []
    for arg, path in (
        ("pipeline_parallel_size", "pipeline.stages"),
        ("sequence_parallel_size", "sequence_parallel_size"),
        ("tensor_parallel_size", "tensor_parallel.autotp_size"),
        ("expert_parallel_size", "expert_parallel.autoep_size"),
    ):
        value = getattr(args, arg, 1)
        from_file = positive_int(get_path(data, path))
        if arg == "expert_parallel_size" and get_path(data, "expert_parallel.enabled") is not True:
            from_file = None  # a disabled section splits nothing
        sizes.append(value if value > 1 or arg in args.model_fields_set or from_file is None else from_file)
    return sizes[0], sizes[1], sizes[2], sizes[3]


def for_zero_init(config: dict[str, Any]) -> dict[str, Any]:
    """The dict ``zero.Init`` builds a ZeRO-3 model with. Its DeepSpeed config check counts every
    rank as data-parallel (it is handed no tensor-parallel groups), so under AutoTP the batch total
    is left out of it: the engine checks that against the real data-parallel size. ``config``
    itself otherwise."""
    if tensor_size_of(config) == 1:
        return config
    return {key: value for key, value in config.items() if key != "train_batch_size"}


def tensor_size_of(config: dict[str, Any]) -> int:
    """The ranks a resolved DeepSpeed dict's AutoTP splits each layer over (1: off)."""
    return positive_int(get_path(config, "tensor_parallel.autotp_size")) or 1


def custom_tensor_plan(run: RunArgs | TrainingArgs) -> bool:
    """Whether the DeepSpeed config gives AutoTP its own sharding rules (``tensor_parallel``'s
    ``partition_config`` or ``preset_model``), for a model it has no plan for."""
    args = run.training if hasattr(run, "training") else run
    try:
        data = base_config(args)[0]
    except ConfigError:
        return False
    return any(
        get_path(data, f"tensor_parallel.{key}") not in (MISSING, None)
        for key in ("partition_config", "preset_model")
    )
