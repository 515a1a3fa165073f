"""The smaller sections: activation checkpointing, checkpoints, async I/O, profilers, monitors, pipeline.

DeepSpeed reads ``activation_checkpointing``, ``checkpoint``, ``aio``, ``flops_profiler`` and
``pipeline`` with ``dict.get``, so it never notices a typo in them; these models do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trainer.config.base import ConfigModel


class ActivationCheckpointingConfig(ConfigModel):
    """How ``deepspeed.checkpointing`` recomputes activations in the backward pass."""

    partition_activations: bool = Field(
        False, description="Split checkpointed activations across model-parallel ranks."
    )
    contiguous_memory_optimization: bool = Field(
        False, description="Copy checkpoints into one contiguous buffer (needs number_checkpoints)."
    )
    cpu_checkpointing: bool = Field(False, description="Keep checkpointed activations in CPU memory.")
    number_checkpoints: int | None = Field(
        None, ge=1, description="Checkpoints per forward pass, to size the contiguous buffer."
    )
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at each checkpoint boundary (for debugging)."
    )
    profile: bool = Field(False, description="Log the time spent in checkpointed forward and recompute.")


class ParallelWriteConfig(ConfigModel):
    """Parallel checkpoint writing."""

    pipeline_stage: bool = Field(
        False, description="Each pipeline stage writes its own part of the checkpoint."
    )


class CheckpointConfig(ConfigModel):
    """Checkpoint loading and saving behaviour of the engine."""

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = Field(
        "WARN", description="What to do when ranks save under different tags: WARN, IGNORE or FAIL."
    )
    load_universal: bool = Field(
        False,
        description="Load a universal checkpoint (the way to resume at a different data-parallel size).",
    )
    use_node_local_storage: bool = Field(
        False, description="Each node writes to its own local storage instead of a shared filesystem."
    )
    parallel_write: ParallelWriteConfig | None = Field(None, description="Parallel checkpoint writing.")

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        # DeepSpeed upper-cases it before comparing, so "Warn" and "warn" are valid too.
        return value.upper() if isinstance(value, str) else value


class AioConfig(ConfigModel):
    """Asynchronous I/O used by NVMe offload (ZeRO-Infinity)."""

    block_size: int = Field(1_048_576, ge=1, description="Bytes per I/O request.")
    queue_depth: int = Field(8, ge=1, description="Requests in flight per thread.")
    intra_op_parallelism: int = Field(1, ge=1, description="Threads per I/O operation.")
    single_submit: bool = Field(False, description="Submit requests one at a time instead of in batches.")
    overlap_events: bool = Field(
        True, description="Overlap submitting requests with waiting for completions."
    )
    use_gds: bool = Field(False, description="Use NVIDIA GPUDirect Storage (CUDA only).")


class FlopsProfilerConfig(ConfigModel):
    """DeepSpeed's FLOPs profiler, run once at profile_step."""

    enabled: bool = Field(False, description="Profile one training step.")
    recompute_fwd_factor: float = Field(
        0.0,
        ge=0,
        description="Extra forward passes from activation recomputation (1.0 with full checkpointing).",
    )
    profile_step: int = Field(1, ge=1, description="The training step to profile.")
    module_depth: int = Field(-1, ge=-1, description="Depth of modules in the report; -1 is all.")
    top_modules: int = Field(1, ge=1, description="Top modules listed in the aggregated report.")
    detailed: bool = Field(True, description="Print the per-module breakdown.")
    output_file: str | None = Field(None, description="Write the report here instead of to stdout.")


class CommsLoggerConfig(ConfigModel):
    """Logging of collective communication calls."""

    enabled: bool = Field(False, description="Log communication operations.")
    verbose: bool = Field(False, description="Print every operation as it happens.")
    prof_all: bool = Field(True, description="Profile all operations (otherwise only prof_ops).")
    debug: bool = Field(False, description="Add the calling function's name to each record.")
    prof_ops: list[str] = Field(
        default_factory=list, description='Operations to profile, e.g. ["all_reduce"].'
    )


class TensorBoardConfig(ConfigModel):
    """DeepSpeed's own TensorBoard monitor (loss, learning rate, loss scale)."""

    enabled: bool = Field(False, description="Write TensorBoard events.")
    output_path: str = Field("", description="Directory for the events; empty means the launch directory.")
    job_name: str = Field("DeepSpeedJobName", description="Subdirectory of output_path for this job.")


class CsvMonitorConfig(ConfigModel):
    """DeepSpeed's own CSV monitor."""

    enabled: bool = Field(False, description="Write monitor values to CSV files.")
    output_path: str = Field("", description="Directory for the files; empty means the launch directory.")
    job_name: str = Field("DeepSpeedJobName", description="Subdirectory of output_path for this job.")


class WandbConfig(ConfigModel):
    """DeepSpeed's own Weights & Biases monitor (needs the wandb package)."""

    enabled: bool = Field(False, description="Log to Weights & Biases.")
    group: str | None = Field(None, description="Run group.")
    team: str | None = Field(None, description="Team (entity).")
    project: str = Field("deepspeed", description="Project name.")


class PipelineConfig(ConfigModel):
    """Pipeline parallelism of a PipelineModule. Needs ZeRO stage 0 or 1."""

    stages: int | None = Field(
        None, ge=1, description="Pipeline stages; unset takes them from the PipelineModule."
    )
    partition: str = Field(
        "best", description="How layers are split over stages: parameters, uniform, type:<regex>, or best."
    )
    seed_layers: bool = Field(False, description="Seed each layer's initialisation from its index.")
    activation_checkpoint_interval: int = Field(
        0, ge=0, description="Checkpoint every N layers; 0 disables it."
    )
    pipe_partitioned: bool = Field(True, description="Partition activations sent between stages.")
    grad_partitioned: bool = Field(True, description="Partition gradients sent between stages.")


class ExpertParallelConfig(ConfigModel):
    """DeepSpeed's AutoEP: each mixture-of-experts layer's experts split over ``autoep_size``
    data-parallel ranks, tokens sent to the rank holding their expert and back. Runs with ZeRO 0-3
    and data parallelism; the model's MoE blocks are found by its HF model type or a preset."""

    enabled: bool = Field(False, description="Replace the model's MoE blocks with expert-parallel ones.")
    autoep_size: int = Field(
        1, ge=1, description="Ranks each layer's experts are split over (it divides them)."
    )
    preset_model: str | None = Field(
        None,
        description="A built-in MoE layout (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3, "
        "minimax_m3); None: found from the model's HF type.",
    )
    expert_tensor_parallel_size: Literal[1] = Field(
        1, description="Ranks each expert is split over; only 1 (experts whole) is supported here."
    )
    moe_layer_pattern: str | None = Field(
        None, description="Regex of the MoE blocks' module names (no preset)."
    )
    router_pattern: str | None = Field(None, description="The router's name inside a block (no preset).")
    expert_pattern: str | None = Field(None, description="The experts' name inside a block (no preset).")
    use_grouped_mm: bool = Field(True, description="Grouped matrix multiplies for the local experts.")
    load_balance_coeff: None = Field(
        None, description="Unsupported by AutoEP; the trainer adds the router loss (router_aux_loss_coef)."
    )


class TensorParallelConfig(ConfigModel):
    """DeepSpeed's AutoTP training: each layer's matrices split over ``autotp_size`` consecutive
    ranks, which read the same rows. Runs with ZeRO 0-3, not with pipeline stages or Ulysses."""

    autotp_size: int = Field(
        0, ge=0, description="Ranks each layer's matrices are split over; 0 or 1 is off."
    )
    tp_overlap_comm: bool = Field(False, description="Overlap the row-parallel all-reduce with computation.")
    vocab_parallel_lm_head: Literal[False] | None = Field(
        None,
        description="false: the output head gives whole-vocabulary logits (what the trainer's token-exact "
        "loss reads; a run fills it in); a vocabulary-split head is refused.",
    )
    preset_model: str | None = Field(
        None,
        description="A built-in sharding plan (llama, bloom, chatglm, mixtral, deepseek_v2, qwen2, phi3).",
    )
    partition_config: dict[str, Any] | None = Field(
        None,
        description="Custom sharding rules (use_default_specs, layer_specs) for a model AutoTP does not know.",
    )
