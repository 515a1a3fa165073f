"""A Trainer's set-up, in one place and in order.

``prepare_training`` is what ``Trainer.train`` runs before its first step: the plan (``plan_run``:
the mesh, the checkpoint to resume and the global batch it keeps, the step plan, the DeepSpeed
dict), the engine built from it (``ensure_engine``), the sets through the Trainer's stages, then
the checkpoint loaded; ``start_window`` then starts the call's logging window. ``evaluate`` and
HF's optimizer methods call ``ensure_engine`` alone where nothing has built the engine yet. Each
reads the Trainer's public attributes only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import enable_full_determinism, set_seed
from transformers.utils import logging as hf_logging

from trainer import checkpoint as ckpt
from trainer.args.recipe import dump_run_config
from trainer.config.files import precision_of
from trainer.data import ResumableDistributedSampler
from trainer.data.loader import train_sampler
from trainer.engine import build_engine
from trainer.loop.callbacks import restore_callback_states
from trainer.loop.plan import RunPlan, plan_run
from trainer.loop.saving import resumed_state
from trainer.loop.stages import prepared
from trainer.loop.steps import client_scheduler, optimizer_for, tiling_for, torch_compile_for
from trainer.model.liger import apply_liger_kernel, check_liger
from trainer.model.modeling import enable_gradient_checkpointing, model_hidden_size, param_counts
from trainer.observe.window import StepTimer, TrainWindow
from trainer.runtime.distributed import DistInfo, Hardware, detect_hardware, init_distributed, print_main
from trainer.runtime.mesh import Mesh, mesh_for
from trainer.runtime.run_files import DS_CONFIG, RUN_CONFIG


def start(args: Any, plan: RunPlan | None) -> tuple[Hardware, DistInfo, Mesh]:
    """A Trainer's start: the seed set, as HF's Trainer sets it (what runs between this and the
    first step, building the engine or a collator's masks, draws from the same generator state as
    HF's); the hardware, the process group and the mesh, the plan's or detected and started here
    (the Liger check first: before the process group, the engine or the data); transformers'
    verbosity and TF32, as the arguments ask."""
    if args.full_determinism:
        enable_full_determinism(args.seed)
    else:
        set_seed(args.seed)
    if plan is not None:
        hardware, dist, mesh = plan.hardware, plan.dist, plan.mesh
    else:
        hardware = detect_hardware()
        check_liger(args, hardware)
        dist = init_distributed(hardware, timeout_s=args.ddp_timeout)
        mesh = mesh_for(args, dist.world_size, dist.rank)
    hf_logging.set_verbosity(args.get_process_log_level())
    if args.tf32 is not None and hardware.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    return hardware, dist, mesh


def plan_for(trainer: Any, spec: Any, num_samples: int | None, total_steps: int) -> RunPlan:
    """The trainer's run planned for resuming ``spec`` (an engine built already keeps its config)."""
    return plan_run(
        trainer.args,
        trainer.hardware,
        trainer.dist,
        num_samples=num_samples,
        total_steps=max(total_steps, 1),
        hidden_size=model_hidden_size(trainer.model),
        resume=spec,
        client_optimizer=trainer.client_optimizer is not None,
        client_scheduler=trainer.client_scheduler is not None,
        ds_config=trainer.ds_config if trainer.engine is not None else None,
    )


def ensure_engine(trainer: Any, total_steps: int) -> None:
    """Build the trainer's engine once, from its plan's DeepSpeed config (an evaluation-only plan
    first, where it has none yet); ``ds_config.json`` and the run config go into ``output_dir``."""
    if trainer.engine is not None:
        return
    if trainer.plan is None:
        trainer.plan = plan_for(trainer, None, None, total_steps)
    args, model = trainer.args, trainer.model
    objective = trainer.make_objective()
    if args.use_liger_kernel:
        apply_liger_kernel(model, args.liger_kernel_config)
    if args.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        enable_gradient_checkpointing(model)
    tiling = tiling_for(args, model, trainer.run_config, objective, trainer.mesh)
    scheduler = trainer.client_scheduler or client_scheduler(args, total_steps, trainer.ds_config)
    with trainer.watchdog.phase("init"):
        trainer.engine = build_engine(
            model,
            trainer.ds_config,
            trainer.mesh,
            optimizer=optimizer_for(args, model, trainer.client_optimizer, trainer.ds_config),
            lr_scheduler=scheduler,
            weight_decay=args.weight_decay,
            gradient_checkpointing=args.gradient_checkpointing,
            objective=objective,
            tiling=tiling,
            torch_compile=torch_compile_for(args),
        )
    if args.requested_precision == "auto":
        chosen, hardware = precision_of(trainer.ds_config), trainer.hardware
        why = hardware.why_default() if chosen == hardware.default_precision() else "the DeepSpeed config's"
        print_main(f"precision auto: {chosen} on {hardware.name} ({why})")
    if trainer.dist.is_main:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / DS_CONFIG).write_text(json.dumps(trainer.ds_config, indent=2, sort_keys=True))
        if trainer.run_config is not None:
            dump_run_config(trainer.run_config, out / RUN_CONFIG)


def prepare_training(trainer: Any, spec: Any) -> ResumableDistributedSampler:
    """Everything before the first step of resuming ``spec``: the run planned (unless the plan
    given is for it and unused), the engine built (one built already, by a second ``train`` or an
    ``evaluate`` first, keeps its config), the sets through the stages, the checkpoint loaded.
    Returns this rank's training sampler."""
    if trainer.train_dataset is None:
        raise ValueError("Trainer.train: train_dataset is required")
    plan = trainer.plan
    if plan is None or trainer.engine is not None or plan.steps is None or plan.resume != spec:
        trainer.plan = plan_for(trainer, spec, len(trainer.train_dataset), trainer.state.max_steps)
    trainer.args, state = trainer.plan.args, trainer.state  # the plan's: its accumulation steps
    state.steps_per_epoch, state.max_steps, state.num_train_epochs = trainer.plan.steps
    ensure_engine(trainer, state.max_steps)
    sampler = train_sampler(
        trainer.train_dataset, *trainer.mesh.data_ranks, trainer.args, trainer.train_lengths
    )
    trainer.train_dataset = prepared(trainer, trainer.train_dataset, "train")
    trainer.eval_dataset = prepared(trainer, trainer.eval_dataset, "eval")  # evaluated after updates
    for stage in trainer.stages:
        stage.started(trainer)
    checkpoint = trainer.plan.checkpoint  # after the stages: a reference scores the weights it starts from
    if checkpoint is not None:
        with trainer.watchdog.phase("load"):
            load_checkpoint(trainer, checkpoint)
        if trainer.args.restore_callback_states_from_checkpoint:
            stored = trainer.state.stateful_callbacks
            trainer.control = restore_callback_states(trainer.callback_handler, stored, trainer.control)
        print_main(f"Resumed from {checkpoint} at step {trainer.state.global_step}.")
    return sampler


def load_checkpoint(trainer: Any, path: Path, weights_only: bool = False) -> None:
    """``path`` loaded into the trainer's engine; unless ``weights_only``, the run's state (and RNG)
    from it too, its position re-divided among this run's data ranks."""
    saved, kept = ckpt.load(trainer.engine, path, trainer.dist, restore_rng=not weights_only)
    if not weights_only:
        trainer.producer.load_state_dict(kept.get("producer", {}))  # a rollout buffer the checkpoint kept
        samples = len(trainer.train_dataset)
        trainer.state = resumed_state(saved, trainer.state, samples, trainer.mesh.data_ranks, trainer.args)


def start_window(trainer: Any) -> TrainWindow:
    """A ``train`` call's logging window and step timer; the parameter counts printed, and kept for
    its logged rows."""
    trainable, total = param_counts(trainer.model, trainer.mesh.tensor)
    params = {"trainable_params": trainable, "total_params": total}
    print_main(f"Parameters: {trainable:,} trainable of {total:,} ({100 * trainable / max(total, 1):.2f}%).")
    precision = precision_of(trainer.ds_config)
    flops = trainer.flops_per_token()
    timer = StepTimer(
        flops, trainer.hardware.name, precision, trainer.args.peak_tflops, trainer.dist.world_size
    )
    return TrainWindow(trainer.engine.device, trainer.mesh.counts_rows, timer, params)
