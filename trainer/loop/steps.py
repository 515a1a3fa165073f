"""How long a run is, which global batch it keeps, and the LR schedules DeepSpeed has no
equivalent of: planned before the engine is built, because the resolved DeepSpeed config
(accumulation, schedule length) and the engine's scheduler depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import get_scheduler

from trainer import checkpoint as ckpt
from trainer.args import TrainingArguments
from trainer.config.files import precision_of
from trainer.config.optim import MuonParams, optim_params
from trainer.engine import Objective, Split, Tiling, TorchCompile, plan_tiling, takes, weight_decay_groups
from trainer.engine.lars import LARS
from trainer.engine.muon import Muon, muon_groups
from trainer.objectives import OBJECTIVES
from trainer.runtime.distributed import print_main
from trainer.runtime.mesh import Mesh


class StepPlan(NamedTuple):
    steps_per_epoch: int
    max_steps: int
    num_train_epochs: int


def plan_steps(args: TrainingArguments, num_samples: int, readers: int) -> StepPlan:
    """Optimizer steps per epoch (the sampler gives each of the mesh's ``readers`` ranks
    ``ceil(n / readers)`` samples; the
    epoch's last window may be short), and the run's length: ``max_steps`` when set, else
    ``num_train_epochs`` of those."""
    per_rank = math.ceil(num_samples / readers)
    micro_per_epoch = math.ceil(per_rank / args.per_device_train_batch_size)
    steps_per_epoch = math.ceil(micro_per_epoch / args.gradient_accumulation_steps)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    return StepPlan(steps_per_epoch, max_steps, math.ceil(max_steps / steps_per_epoch))


def kept_accumulation(args: TrainingArguments, checkpoint: Path, data_parallel: int) -> int | None:
    """Resuming on another number of ranks: the accumulation steps that keep the checkpoint's global
    batch (and so the run's trajectory) on ``data_parallel`` replicas; None where they stay as set.
    The caller (``plan_run``) carries the value in its plan; the arguments are not changed."""
    gas = ckpt.accumulation_for(checkpoint, data_parallel, args.per_device_train_batch_size)
    if gas is None or gas == args.gradient_accumulation_steps:
        return None
    print_main(f"{checkpoint.name}: gradient_accumulation_steps {args.gradient_accumulation_steps} -> {gas}")
    return gas


def tiling_for(
    args: TrainingArguments, model: Any, run_config: Any, objective: Objective, mesh: Mesh
) -> Tiling:
    """The run's tiling. ``tiled_loss: auto`` judges the largest micro-batch: its rows (a pair's two
    sequences each) times the block size (TRL's ``max_length`` in a TRL trainer, else the model's
    longest context without a run config), split over the ``mesh``'s sequence-parallel group;
    it stays off where the objective does not take a tiled loss (``Objective.check``: a model's own
    loss, a ``compute_loss`` override, SFT's ``dft``), the pipeline computes the loss, or the
    loss is label-smoothed (the tiles compute plain cross-entropy)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    block = (
        run_config.data.block_size
        if run_config
        else getattr(args, "max_length", None) or getattr(text, "max_position_embeddings", 0)
    )
    auto_off = not takes(objective, Split(tiles=True)) or mesh.pipeline > 1 or args.label_smoothing_factor > 0
    mode = "false" if auto_off and args.tiled_loss == "auto" else args.tiled_loss
    rows = args.per_device_train_batch_size * OBJECTIVES[args.objective].sequences_per_row
    tokens = rows * (block or 0) // mesh.sequence
    vocab = getattr(text, "vocab_size", None) or 1
    tiling = plan_tiling(mode, args.tiled_mlp, args.offload_activations, args.tile_tokens, vocab, tokens)
    if tiling.loss:
        print_main(f"The loss in tiles of {tiling.loss:,} tokens: no micro-batch's logits are held whole.")
    return tiling


def optimizer_for(
    args: TrainingArguments,
    model: torch.nn.Module,
    client: torch.optim.Optimizer | None,
    ds_config: dict[str, Any],
) -> torch.optim.Optimizer | None:
    """The optimizer the engine hands DeepSpeed: the caller's own; LARS for ``optim lars`` (DeepSpeed
    has none), over the usual decay groups; our Muon where the resolved config's section is Muon
    (its settings are there); None lets DeepSpeed build its config's."""
    if client is not None:
        return client
    if args.optim == "lars":
        groups = weight_decay_groups(model, args.weight_decay)
        lars = optim_params("lars", args.optim_args)
        return LARS(groups, lr=args.learning_rate, weight_decay=args.weight_decay, **lars)
    section = ds_config.get("optimizer") or {}
    if section.get("type") != "Muon":
        return None
    muon = MuonParams.model_validate(section.get("params") or {})
    lr = muon.lr
    muon_lr, adam_lr = (lr if rate is None else rate for rate in (muon.muon_lr, muon.adam_lr))
    groups = muon_groups(model, muon.weight_decay, muon_lr, adam_lr)
    return Muon(
        groups,
        lr=lr,
        weight_decay=muon.weight_decay,
        momentum=muon.momentum,
        nesterov=muon.nesterov,
        ns_steps=muon.ns_steps,
        update_scale=muon.update_scale,
        # unset: the run's own precision where it trains in bf16/fp16 (torch's bf16), else the device's
        ns_precision=muon.ns_precision or ("bf16" if precision_of(ds_config) != "fp32" else None),
        betas=muon.betas,
        adam_eps=muon.eps,
    )


def torch_compile_for(args: TrainingArguments) -> TorchCompile | None:
    """HF's torch_compile fields: compiling is on when torch_compile is set or a backend or mode is
    named, with inductor unless another backend is (as HF's TrainingArguments decide)."""
    if not (args.torch_compile or args.torch_compile_backend or args.torch_compile_mode):
        return None
    options = {"mode": args.torch_compile_mode} if args.torch_compile_mode else {}
    return TorchCompile(args.torch_compile_backend or "inductor", options)


def client_scheduler(
    args: TrainingArguments, total_steps: int, ds_config: dict[str, Any]
) -> Callable[[torch.optim.Optimizer], Any] | None:
    """transformers' ``get_scheduler`` where the resolved DeepSpeed config has no scheduler (every
    HF schedule but a constant rate, unless the user's file names one), as the callable
    ``deepspeed.initialize`` calls with the optimizer it built; None where the config has one.
    DeepSpeed then steps it after every optimizer step and saves its state in every checkpoint."""
    if "scheduler" in ds_config:
        return None
    warmup = args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total_steps)
    kind, kwargs = args.lr_scheduler_type, dict(args.lr_scheduler_kwargs)  # not the arguments: the
    # engine keeps this callable, and the arguments must be freed with the Trainer

    def build(optimizer: torch.optim.Optimizer) -> Any:
        return get_scheduler(
            kind,
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            scheduler_specific_kwargs=kwargs,
        )

    return build
