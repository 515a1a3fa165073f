"""A run's plan, made once by ``plan_run`` and read by everything after it: ``trainer train`` and
``build_run`` (through the Trainer they build), the benchmarks, and a ``Trainer`` built by hand (which
plans its run when ``train`` or ``evaluate`` first needs it, unless it was given one).

The plan holds the mesh (every parallel size, built once here: ``trainer/runtime/mesh.py``), the step
plan, the checkpoint to resume and the global batch it keeps, and the resolved DeepSpeed dict:
under ZeRO-3 a hand-built run's dict is the very one its ``TrainingArguments`` registered for
``zero.Init`` when they were created, finalised in place (``args.hf.finalize_zero3``), as HF's Trainer
finalises the config its arguments registered.

The user's arguments are never changed. Where a resumed checkpoint's global batch changes the
accumulation steps, ``RunPlan.args`` is a copy of them with the effective value: the loop, the data
windows, the callbacks and the checkpoints (which record the arguments they ran with) read
``gradient_accumulation_steps`` from the arguments as HF's code does, so handing them that copy
keeps one spelling of the value for all of them. Where nothing changes it is the user's object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer import checkpoint as ckpt
from trainer.args import RunConfig, TrainingArguments
from trainer.args.hf import finalize_zero3
from trainer.checkpoint.snapshots import snapshot_dir
from trainer.config import ConfigError, Hardware, resolve
from trainer.loop.auto_batch import check_auto_batch
from trainer.loop.steps import StepPlan, kept_accumulation, plan_steps
from trainer.runtime.distributed import DistInfo
from trainer.runtime.mesh import Mesh, mesh_for

KEEP = object()  # resume_from_checkpoint not given to plan_run: the arguments' own


@dataclass(frozen=True)
class RunPlan:
    hardware: Hardware
    dist: DistInfo
    mesh: Mesh
    args: TrainingArguments  # the user's, or a copy with the effective accumulation steps
    steps: StepPlan | None  # None: no training data (an evaluation-only run)
    total_steps: int  # the schedule's length
    checkpoint: Path | None  # the verified checkpoint to resume
    resume: Any  # the resume_from_checkpoint spec the checkpoint was found for
    ds_config: dict[str, Any]


def plan_run(
    run: RunConfig | TrainingArguments,
    hardware: Hardware,
    dist: DistInfo,
    *,
    num_samples: int | None,
    total_steps: int | None = None,
    hidden_size: int | None = None,
    resume: Any = KEEP,
    client_optimizer: bool = False,
    client_scheduler: bool = False,
    ds_config: dict[str, Any] | None = None,
) -> RunPlan:
    """The run's plan, after the process group is up (the checkpoint to resume is verified on every
    rank). ``num_samples``: the training set's size (None: evaluation only, whose schedule spans
    ``total_steps`` if given, else ``max_steps``, or one step). ``resume``: the
    ``resume_from_checkpoint`` spec (default: the arguments'). ``ds_config``: an engine's config
    already built, kept as it is.

    Where the arguments registered a ZeRO-3 config with transformers when they were created (a
    hand-built run: the script's model is partitioned by ``zero.Init`` with it), the resolution is
    filled into that dict and the plan holds it: ``zero.Init``'s config and the engine's are one
    object; a resolution that would change what ``zero.Init`` used is refused, naming the key."""
    args = user_args = run.training if isinstance(run, RunConfig) else run
    mesh = mesh_for(args, dist.world_size, dist.rank)
    spec = args.resume_from_checkpoint if resume is KEEP else resume
    snapshots = snapshot_dir(args.output_dir) if args.snapshot_steps else None
    checkpoint = ckpt.find_resumable(spec, args.output_dir, dist, snapshots)
    if checkpoint is not None:
        gas = kept_accumulation(args, checkpoint, mesh.data_parallel_size)
        if gas is not None:
            args = args.model_copy(update={"gradient_accumulation_steps": gas})
    steps = plan_steps(args, num_samples, mesh.readers) if num_samples is not None else None
    if steps is not None:
        total_steps = steps.max_steps
    elif total_steps is None:
        total_steps = max(args.max_steps, 1)
    if ds_config is None:
        source: Any = args
        if isinstance(run, RunConfig):  # its model arguments size the ZeRO-3 buckets when not given
            source = run if args is run.training else run.model_copy(update={"training": args})
        ds_config = resolve(
            source,
            world_size=mesh.world_size,
            hardware=hardware,
            hidden_size=hidden_size,
            total_steps=total_steps,
            client_optimizer=client_optimizer,
            client_scheduler=client_scheduler,
            data_parallel=mesh.data_parallel_size,
        )
        ds_config = finalize_zero3(user_args, ds_config)
    if checkpoint is not None:  # a checkpoint this run's objective, stage or mesh cannot load: one line, now
        stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
        if refused := ckpt.uncarried(checkpoint, args.objective, stage, mesh):
            raise ConfigError([refused])
    check_auto_batch(args, ds_config, mesh)  # before the model is built (build_run) or trained
    return RunPlan(hardware, dist, mesh, args, steps, total_steps, checkpoint, spec, ds_config)
