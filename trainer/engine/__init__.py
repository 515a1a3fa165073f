"""Engines: how the Trainer's steps are carried out by DeepSpeed.

``Engine`` is the contract (``core``); ``DeepSpeedEngine`` drives ZeRO 0-3 and ``PipelineEngine``
pipeline stages; ``build_engine`` picks one for a resolved DeepSpeed config.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.errors import ConfigError
from trainer.engine.core import Batch, Engine, LossFn, is_decayed, weight_decay_groups
from trainer.engine.deepspeed_engine import ComputeLoss, DeepSpeedEngine
from trainer.engine.loss import causal_lm_loss_sum, count_targets
from trainer.engine.pipeline_engine import PipelineEngine
from trainer.engine.tiling import Tiling, plan_tiling

__all__ = [
    "Batch",
    "ComputeLoss",
    "DeepSpeedEngine",
    "Engine",
    "LossFn",
    "PipelineEngine",
    "Tiling",
    "build_engine",
    "causal_lm_loss_sum",
    "count_targets",
    "is_decayed",
    "plan_tiling",
    "weight_decay_groups",
]


def build_engine(
    model: torch.nn.Module,
    ds_config: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    weight_decay: float = 0.0,
    gradient_checkpointing: bool = False,
    compute_loss: ComputeLoss | None = None,
    tiling: Tiling = Tiling(),
) -> Engine:
    """The engine for ``ds_config``: a pipeline when it has two or more stages. ``compute_loss``: a
    Trainer subclass's override, which a pipeline cannot run (no stage holds the whole model), nor
    sequence parallelism (no rank holds a whole row)."""
    sequence_parallel = int(ds_config.get("sequence_parallel_size") or 1)
    stages = int((ds_config.get("pipeline") or {}).get("stages") or 1)
    if tiling != Tiling() and stages > 1:
        raise ConfigError(
            "tiled_loss, tiled_mlp and offload_activations run with ZeRO 0-3, not with pipeline stages",
            path="tiled_loss",
        )
    if (sequence_parallel > 1 or tiling.loss) and compute_loss is not None:
        raise ConfigError(
            "a Trainer subclass's compute_loss sees whole rows and logits; with sequence_parallel_size > 1 "
            "(each rank holds a slice of every row) or a tiled loss the engine computes the causal-LM loss. "
            "Drop the override, or set tiled_loss false.",
            path="compute_loss",
        )
    if stages > 1:
        if compute_loss is not None:
            raise ConfigError(
                "a Trainer subclass's compute_loss needs the whole model on each rank; with "
                "pipeline_parallel_size > 1 the last stage computes the causal-LM loss. Drop the override "
                "or the pipeline.",
                path="compute_loss",
            )
        return PipelineEngine(
            model,
            ds_config,
            optimizer,
            lr_scheduler,
            weight_decay,
            gradient_checkpointing=gradient_checkpointing,
        )
    return DeepSpeedEngine(
        model, ds_config, optimizer, lr_scheduler, weight_decay, compute_loss, sequence_parallel, tiling
    )
