"""Engines: how the Trainer's steps are carried out by DeepSpeed.

``Engine`` is the contract (``core``); ``DeepSpeedEngine`` drives ZeRO 0-3 and ``PipelineEngine``
pipeline stages; ``build_engine`` picks one for a resolved DeepSpeed config.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.errors import ConfigError
from trainer.engine.core import Batch, Engine, TorchCompile, is_decayed, weight_decay_groups
from trainer.engine.deepspeed_engine import DeepSpeedEngine
from trainer.engine.objectives import (
    CausalLM,
    ComputeLoss,
    ModelLoss,
    Objective,
    Split,
    Tokens,
    batch_rows,
    causal_lm_loss_sum,
    count_targets,
    is_causal_lm,
    objective_for,
    takes,
)
from trainer.engine.pipeline_engine import PipelineEngine
from trainer.engine.routers import Routers
from trainer.engine.tiling import Tiling, plan_tiling
from trainer.runtime.mesh import Mesh

__all__ = [
    "Batch",
    "CausalLM",
    "ComputeLoss",
    "DeepSpeedEngine",
    "Engine",
    "ModelLoss",
    "Objective",
    "PipelineEngine",
    "Tiling",
    "Split",
    "Tokens",
    "TorchCompile",
    "batch_rows",
    "build_engine",
    "causal_lm_loss_sum",
    "count_targets",
    "is_causal_lm",
    "is_decayed",
    "objective_for",
    "plan_tiling",
    "takes",
    "weight_decay_groups",
]


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    mesh: Mesh,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    weight_decay: float = 0.0,
    gradient_checkpointing: bool = False,
    objective: Objective | None = None,
    tiling: Tiling = Tiling(),
    torch_compile: TorchCompile | None = None,
) -> Engine:
    """The engine for ``ds_config`` on ``mesh``: a pipeline when it has two or more stages. What the
    run splits (rows over a sequence-parallel group, the head into loss tiles, the model into
    stages) the objective is asked once, before anything is built (``Objective.check``): a loss
    over the model's own output takes none of them. ``torch_compile`` compiles the model through
    DeepSpeed's engine (not under a pipeline)."""
    objective = objective or CausalLM()
    sequence_parallel, stages = mesh.sequence, mesh.pipeline
    if tiling != Tiling() and stages > 1:
        raise ConfigError(
            "tiled_loss, tiled_mlp and offload_activations run with ZeRO 0-3, not with pipeline stages",
            path="tiled_loss",
        )
    split = Split(sequence=sequence_parallel > 1, tiles=bool(tiling.loss), stages=stages > 1)
    objective.check(split)
    objective.route(Routers.of(model), split)
    if torch_compile is not None and stages > 1:
        raise ConfigError(
            "torch_compile with pipeline_parallel_size > 1: the pipeline's stages are not compiled here; "
            "set torch_compile false or pipeline_parallel_size 1",
            path="torch_compile",
        )
    if stages > 1:
        return PipelineEngine(
            model,
            ds_config,
            mesh,
            optimizer,
            lr_scheduler,
            weight_decay,
            gradient_checkpointing=gradient_checkpointing,
            objective=objective,
        )
    return DeepSpeedEngine(
        model,
        ds_config,
        mesh,
        optimizer,
        lr_scheduler,
        weight_decay,
        objective,
        tiling,
        torch_compile,
    )
