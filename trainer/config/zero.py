"""``zero_optimization`` and its two offload blocks."""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import Field, model_validator

from trainer.config.base import ConfigModel, Problem, rule_error

OffloadDevice = Literal["none", "cpu", "nvme"]

_REMOVED = "https://github.com/deepspeedai/DeepSpeed/issues/8489"


class _OffloadBase(ConfigModel):
    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadBase:
        if self.device == "nvme" and not self.nvme_path:
            raise rule_error(
                [("device, nvme_path", "device nvme needs an nvme_path (a directory on a fast local NVMe)")]
            )
        return self


class OffloadParamConfig(_OffloadBase):
    """Where ZeRO-3 keeps parameters between uses (``zero_optimization.offload_param``)."""

    device: OffloadDevice = Field(
        "none", description="Offload parameters to cpu or nvme; none keeps them on the GPU."
    )
    nvme_path: str | None = Field(None, description="Directory for parameter swap files when device is nvme.")
    pin_memory: bool = Field(
        True, description="Use page-locked CPU memory: faster transfers, but it cannot be swapped out."
    )
    buffer_count: int = Field(5, ge=0, description="Buffers in the pool for parameter offload to NVMe.")
    buffer_size: int = Field(
        100_000_000, ge=0, description="Elements per buffer for parameter offload to NVMe."
    )
    max_in_cpu: int = Field(
        1_000_000_000, ge=0, description="Parameter elements kept in CPU memory when offloading to NVMe."
    )


class OffloadOptimizerConfig(_OffloadBase):
    """Where optimizer states live and where the optimizer step runs (``zero_optimization.offload_optimizer``)."""

    device: OffloadDevice = Field(
        "none",
        description="Offload optimizer states (and the optimizer step) to cpu or nvme; none keeps them on the GPU.",
    )
    nvme_path: str | None = Field(
        None, description="Directory for optimizer-state swap files when device is nvme."
    )
    pin_memory: bool = Field(
        True, description="Use page-locked CPU memory: faster transfers, but it cannot be swapped out."
    )
    buffer_count: int = Field(
        4, ge=0, description="Buffers for NVMe offload; at least the states per parameter (4 for Adam)."
    )
    pipeline_read: bool = Field(False, description="Overlap reading the next tile with the step (NVMe).")
    pipeline_write: bool = Field(False, description="Overlap writing the previous tile with the step (NVMe).")
    fast_init: bool = Field(False, description="Faster optimizer initialisation when offloading to NVMe.")
    ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of optimizer states offloaded; below 1 (partial offload) needs stage 3.",
    )


# The ZeRO-3 knobs DeepSpeed accepts both with and without the "stage3_" prefix.
STAGE3_KNOBS = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)


class LeafModuleConfig(ConfigModel):
    """ZeRO-3 leaf modules: gathered whole when entered, with no hooks inside (mixture-of-experts
    blocks, whose ranks run different experts). The engine also marks every expert block it finds
    in the model (a list of experts beside a router), whatever its class."""

    classes: list[str] = Field(
        default_factory=lambda: [
            "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
            "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
            "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
        ],
        description="Classes (import path or name) whose instances are leaves; DeepSpeed's default lists three HF MoE blocks.",
    )
    names: list[str] = Field(default_factory=list, description="Module names (as named_modules gives them).")
    name_suffixes: list[str] = Field(default_factory=list, description="Suffixes of module names.")


class ZeroConfig(ConfigModel):
    """ZeRO partitioning of optimizer states (stage 1), gradients (2) and parameters (3)."""

    removed_keys = {
        "mics_shard_size": f"MiCS ZeRO-3 sharding was removed ({_REMOVED})",
        "mics_hierarchical_params_gather": f"MiCS ZeRO-3 sharding was removed ({_REMOVED})",
        "zeropp_loco_param": f"LoCo-ZeRO++ was removed ({_REMOVED})",
    }
    key_hints = {
        "cpu_offload": 'deprecated; use offload_optimizer: {"device": "cpu"}',
        "cpu_offload_param": 'deprecated; use offload_param: {"device": "cpu"}',
        "cpu_offload_use_pin_memory": "deprecated; use offload_optimizer.pin_memory / offload_param.pin_memory",
        "stage3_gather_fp16_weights_on_model_save": "renamed; use stage3_gather_16bit_weights_on_model_save",
    }

    stage: int = Field(
        0,
        ge=0,
        le=3,
        description="0 disables ZeRO; 1 partitions optimizer states, 2 also gradients, 3 also parameters.",
    )
    contiguous_gradients: bool = Field(
        True,
        description="Copy gradients into one contiguous buffer as they are produced (less fragmentation).",
    )
    reduce_scatter: bool = Field(
        True, description="Average gradients with reduce-scatter instead of all-reduce."
    )
    reduce_bucket_size: int = Field(
        500_000_000,
        gt=0,
        description="Elements reduced at a time; resolution sets it to hidden_size² for ZeRO-3.",
    )
    allgather_partitions: bool = Field(
        True, description="Gather updated parameters with one all-gather instead of a series of broadcasts."
    )
    allgather_bucket_size: int = Field(500_000_000, ge=0, description="Elements all-gathered at a time.")
    overlap_comm: bool | None = Field(
        None,
        description="Overlap gradient reduction with the backward pass (DeepSpeed: on for stage 3, else off).",
    )
    load_from_fp32_weights: bool = Field(
        True,
        description="Restore fp32 master weights from the checkpoint's fp32 copy rather than the 16-bit one.",
    )
    round_robin_gradients: bool = Field(
        False,
        description="Stage 1/2 with CPU offload: spread gradient copies over ranks in fine-grained pieces.",
    )
    ignore_unused_parameters: bool = Field(
        True, description="Stage 2: tolerate parameters that get no gradient instead of failing."
    )
    use_multi_rank_bucket_allreduce: bool = Field(
        True, description="Combine the reduce buckets of all ranks into one all-reduce."
    )
    sub_group_size: int = Field(
        1_000_000_000,
        ge=0,
        description="Parameter elements per optimizer-step tile (ZeRO-3 offload and NVMe).",
    )
    zero_hpz_partition_size: int = Field(
        1, ge=0, description="ZeRO++ hierarchical partitioning: ranks in the secondary parameter group."
    )
    zero_quantized_weights: bool = Field(False, description="ZeRO++: quantize weights for the all-gather.")
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++: keep non-trainable weights quantized in memory (e.g. for LoRA)."
    )
    zero_quantized_gradients: bool = Field(False, description="ZeRO++: quantize gradients for the reduction.")
    offload_param: OffloadParamConfig | None = Field(
        None, description="Parameter offload to CPU or NVMe; stage 3 only."
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Optimizer-state offload to CPU or NVMe; stages 1-3."
    )
    leaf_module: LeafModuleConfig | None = Field(
        None, description="ZeRO-3 leaf modules, beyond the expert blocks the engine finds itself."
    )

    prefetch_bucket_size: int = Field(
        50_000_000,
        ge=0,
        alias="stage3_prefetch_bucket_size",
        description="ZeRO-3: parameter elements fetched ahead of use; resolution sets it to 0.9 × hidden_size².",
    )
    param_persistence_threshold: int = Field(
        100_000,
        ge=0,
        alias="stage3_param_persistence_threshold",
        description="ZeRO-3: parameters smaller than this stay unpartitioned; resolution sets 10 × hidden_size.",
    )
    model_persistence_threshold: int = Field(
        sys.maxsize,
        ge=0,
        alias="stage3_model_persistence_threshold",
        description="ZeRO-3: cap on the total elements kept unpartitioned by param_persistence_threshold.",
    )
    max_live_parameters: int = Field(
        1_000_000_000,
        ge=0,
        alias="stage3_max_live_parameters",
        description="ZeRO-3: parameter elements resident per GPU before release.",
    )
    max_reuse_distance: int = Field(
        1_000_000_000,
        ge=0,
        alias="stage3_max_reuse_distance",
        description="ZeRO-3: keep a parameter that is reused within this many elements.",
    )
    gather_16bit_weights_on_model_save: bool = Field(
        False,
        alias="stage3_gather_16bit_weights_on_model_save",
        description="ZeRO-3: gather full 16-bit weights in save_16bit_model (otherwise it writes nothing).",
    )
    module_granularity_threshold: int = Field(
        0,
        ge=0,
        alias="stage3_module_granularity_threshold",
        description="ZeRO-3: modules finer than this are fetched as one unit (fewer hooks).",
    )
    use_all_reduce_for_fetch_params: bool = Field(
        False,
        alias="stage3_use_all_reduce_for_fetch_params",
        description="ZeRO-3: fetch parameters with all-reduce instead of all-gather.",
    )
    allgather_sequential: bool = Field(
        False,
        alias="stage3_allgather_sequential",
        description="ZeRO-3: all-gather parameters one by one, bypassing buckets (less peak memory).",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_knob(cls, data: Any) -> Any:
        if isinstance(data, dict):
            both = [
                (f"stage3_{k}, {k}", "both names given; use one")
                for k in STAGE3_KNOBS
                if k in data and f"stage3_{k}" in data
            ]
            if both:
                raise rule_error(both)
        return data

    @model_validator(mode="after")
    def _offload_rules(self) -> ZeroConfig:
        problems: list[Problem] = []
        param, optim = self.offload_param, self.offload_optimizer
        if param is not None and param.device != "none" and self.stage != 3:
            problems.append(
                (
                    "offload_param.device, stage",
                    f"parameter offload needs ZeRO stage 3, got stage {self.stage}",
                )
            )
        if optim is not None and optim.device != "none" and self.stage == 0:
            problems.append(
                (
                    "offload_optimizer.device, stage",
                    "optimizer offload needs ZeRO stage 1, 2 or 3, got stage 0",
                )
            )
        if optim is not None and optim.ratio < 1 and self.stage != 3:
            problems.append(
                (
                    "offload_optimizer.ratio, stage",
                    f"a ratio below 1 (partial optimizer offload) needs ZeRO stage 3, got stage {self.stage}",
                )
            )
        if problems:
            raise rule_error(problems)
        return self

    def offload_device(self, which: Literal["param", "optimizer"]) -> str:
        block = self.offload_param if which == "param" else self.offload_optimizer
        return block.device if block is not None else "none"
