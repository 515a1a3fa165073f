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
from trainer.engine.loss import causal_lm_loss_sum, count_targets
from trainer.engine.objectives import (
    CausalLM,
    ComputeLoss,
    ModelLoss,
    Objective,
    batch_rows,
    is_causal_lm,
    objective_for,
)
from trainer.engine.pipeline_engine import PipelineEngine
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
    "TorchCompile",
    "batch_rows",
    "build_engine",
    "causal_lm_loss_sum",
    "count_targets",
    "is_causal_lm",
    "is_decayed",
    "objective_for",
    "plan_tiling",
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
    """The engine for ``ds_config`` on ``mesh``: a pipeline when it has two or more stages. The pipeline,
    sequence parallelism and the tiled loss compute the token-exact causal-LM loss themselves (no
    stage holds the whole model, no rank a whole row, no step the whole logits), so they refuse
    any other objective: a model that is not a causal LM, or a ``compute_loss`` override. The
    preference objectives take per-token NLL from the tiles and from the ranks of a split sequence.
    ``torch_compile`` compiles the model through DeepSpeed's engine (not under a pipeline)."""
    objective = objective or CausalLM()
    sequence_parallel, stages = mesh.sequence, mesh.pipeline
    if tiling != Tiling() and stages > 1:
        raise ConfigError(
            "tiled_loss, tiled_mlp and offload_activations run with ZeRO 0-3, not with pipeline stages",
            path="tiled_loss",
        )
    # (on, what it is, whether this objective computes it): an objective that weighs per-token NLL
    # itself (``per_token_nll``: the preference losses) runs with a tiled loss and split sequences.
    per_token = objective.per_token_nll
    features = [
        (
            sequence_parallel > 1,
            "sequence_parallel_size > 1 (each rank holds a slice of every row)",
            per_token,
        ),
        (bool(tiling.loss), "a tiled loss (never the whole logits at once)", per_token),
        (stages > 1, "pipeline_parallel_size > 1 (the last stage computes the loss)", False),
    ]
    for on, feature, supported in features:
        if on and not (objective.token_exact_causal or supported):
            why = " (a model that is not a causal LM, or a Trainer subclass's compute_loss)"
            raise ConfigError(
                f"{feature} computes the causal-LM loss itself; this run's objective is "
                f"{type(objective).__name__}{why if isinstance(objective, ModelLoss) else ''}. "
                "Run without that feature.",
                path="compute_loss"
                if isinstance(objective, ModelLoss) and objective.compute_loss
                else "model",
            )
    if tiling.loss and getattr(objective, "label_smoothing", 0.0):
        raise ConfigError(
            "label_smoothing_factor with a tiled loss: the tiles compute plain cross-entropy; set "
            "tiled_loss false or label_smoothing_factor 0",
            path="label_smoothing_factor",
        )
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
