"""The whole DeepSpeed config, its cross-field rules, and ``validate()``.

The rules here are those DeepSpeed checks late (inside ``initialize``, after the model is loaded)
or not at all. The batch arithmetic needs the world size, so it lives in ``batch_problems``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from trainer.config.base import ConfigModel, Problem, dedupe, problems_from_error, rule_error
from trainer.config.errors import ConfigError
from trainer.config.optim import OFFLOAD_NOTE, ZERO_TESTED_OPTIMIZERS, OptimizerConfig, SchedulerConfig
from trainer.config.precision import BF16Config, DataTypesConfig, FP16Config, normalise_dtype
from trainer.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    ExpertParallelConfig,
    FlopsProfilerConfig,
    PipelineConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    WandbConfig,
)
from trainer.config.zero import ZeroConfig

_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

# Top-level keys DeepSpeed 0.19 removed; it raises on them, and so do we, before anything loads.
REMOVED_TOP_LEVEL = {
    "elasticity": "elastic training was removed; set train_batch_size / train_micro_batch_size_per_gpu / "
    "gradient_accumulation_steps directly",
    "amp": "NVIDIA Apex AMP was removed; use fp16 or bf16",
    "nebula": f"Nebula checkpointing was removed ({_ISSUE})",
    "sparse_attention": f"Sparse Attention was removed ({_ISSUE})",
    "compression_training": f"the compression library was removed ({_ISSUE})",
    "quantize_training": f"Mixture-of-Quantization was removed ({_ISSUE})",
    "sparse_gradients": f"sparse embedding-gradient compression was removed ({_ISSUE})",
    "eigenvalue": f"eigenvalue-based MoQ was removed ({_ISSUE})",
    "graph_harvesting": f"graph harvesting was removed ({_ISSUE})",
    "curriculum_learning": "the top-level block was removed (DeepSpeed now reads it under data_efficiency, "
    "which this schema does not cover)",
    "progressive_layer_drop": f"Progressive Layer Dropping was removed ({_ISSUE})",
}

BATCH_KEYS = "train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps"


class DSConfig(ConfigModel):
    """The top level of a DeepSpeed config."""

    removed_keys = REMOVED_TOP_LEVEL
    key_hints = {"bfloat16": "renamed; use bf16"}

    train_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step over all ranks: micro × accumulation × data-parallel size.",
    )
    train_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="Samples per forward/backward on each rank (HF: per_device_train_batch_size)."
    )
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches accumulated per optimizer step."
    )
    gradient_clipping: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this; 0 disables."
    )
    steps_per_print: int | None = Field(None, ge=1, description="DeepSpeed prints progress every N steps.")
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward and step separately (adds synchronisation)."
    )
    zero_allow_untested_optimizer: bool = Field(
        False, description="Allow ZeRO with optimizers it was not tested with (SGD, Lamb, the mup ones)."
    )
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With CPU offload, refuse a client optimizer that is not DeepSpeed's CPU Adam/Lion."
    )
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the world size before the all-reduce."
    )
    gradient_predivide_factor: float = Field(
        1.0, gt=0, description="Divide gradients by this before the all-reduce and by world/factor after."
    )
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="Dtype of gradient communication; unset follows the training precision."
    )

    zero_optimization: ZeroConfig | None = Field(None, description="ZeRO stages and offload.")
    fp16: FP16Config | None = Field(None, description="fp16 mixed precision.")
    bf16: BF16Config | None = Field(None, description="bf16 mixed precision.")
    data_types: DataTypesConfig | None = Field(
        None, description="Dtypes of accumulation, parameters and buffers."
    )
    optimizer: OptimizerConfig | None = Field(None, description="The optimizer DeepSpeed builds.")
    scheduler: SchedulerConfig | None = Field(None, description="The learning-rate schedule.")
    activation_checkpointing: ActivationCheckpointingConfig | None = Field(
        None, description="deepspeed.checkpointing settings."
    )
    checkpoint: CheckpointConfig | None = Field(None, description="Checkpoint save/load behaviour.")
    aio: AioConfig | None = Field(None, description="Async I/O for NVMe offload.")
    flops_profiler: FlopsProfilerConfig | None = Field(None, description="The FLOPs profiler.")
    comms_logger: CommsLoggerConfig | None = Field(None, description="The communication logger.")
    tensorboard: TensorBoardConfig | None = Field(None, description="DeepSpeed's TensorBoard monitor.")
    csv_monitor: CsvMonitorConfig | None = Field(None, description="DeepSpeed's CSV monitor.")
    wandb: WandbConfig | None = Field(None, description="DeepSpeed's Weights & Biases monitor.")
    pipeline: PipelineConfig | None = Field(None, description="Pipeline parallelism (ZeRO stage 0 or 1).")
    sequence_parallel_size: int | None = Field(
        None, ge=1, description="Ulysses sequence parallelism: ranks that split each sequence."
    )
    tensor_parallel: TensorParallelConfig | None = Field(
        None, description="AutoTP tensor parallelism: ranks that split each layer's matrices."
    )
    expert_parallel: ExpertParallelConfig | None = Field(
        None, description="AutoEP expert parallelism: ranks that split each MoE layer's experts."
    )

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never_print(cls, value: Any) -> Any:
        # Accelerate writes infinity to mean "never"; leaving the key out means the same to DeepSpeed.
        if value == float("inf") or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity")):
            return None
        return value

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalise_dtype(value)

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage if self.zero_optimization else 0

    @property
    def precision(self) -> str:
        if self.fp16 is not None and self.fp16.enabled:
            return "fp16"
        if self.bf16 is not None and self.bf16.enabled:
            return "bf16"
        return "fp32"

    @model_validator(mode="after")
    def _cross_field_rules(self) -> DSConfig:
        problems: list[Problem] = []
        stage = self.zero_stage
        if self.fp16 is not None and self.fp16.enabled and self.bf16 is not None and self.bf16.enabled:
            problems.append(("fp16.enabled, bf16.enabled", "both enabled; choose one precision"))
        if self.pipeline is not None and stage >= 2:
            problems.append(
                (
                    "pipeline, zero_optimization.stage",
                    f"pipeline parallelism needs ZeRO stage 0 or 1, got stage {stage}",
                )
            )
        if self.pipeline is not None and self.wall_clock_breakdown and self.steps_per_print is None:
            # DeepSpeed's pipeline engine takes global_steps % steps_per_print when it times a step.
            problems.append(
                (
                    "pipeline, wall_clock_breakdown, steps_per_print",
                    "the pipeline engine's timing needs steps_per_print; set it (e.g. 10)",
                )
            )
        if self.bf16 is not None and self.bf16.bf16_master_weights_and_grads and stage == 0:
            problems.append(
                (
                    "bf16.bf16_master_weights_and_grads, zero_optimization.stage",
                    "bf16 master weights need ZeRO stage 1, 2 or 3, got stage 0",
                )
            )
        sequence_split = (self.sequence_parallel_size or 1) > 1
        if sequence_split and stage == 3 and not self.zero_optimization.reduce_scatter:
            # Its other reduction then depends on the bucket size; the loss scale would not fit both.
            problems.append(
                (
                    "zero_optimization.reduce_scatter, sequence_parallel_size",
                    "ZeRO-3 with sequence parallelism averages gradients by reduce-scatter; "
                    "leave reduce_scatter true",
                )
            )
        staged = self.pipeline is not None and (self.pipeline.stages or 1) > 1
        if sequence_split and staged:
            problems.append(
                (
                    "pipeline.stages, sequence_parallel_size",
                    "sequence parallelism does not run with pipeline stages",
                )
            )
        if tensor_size(self) > 1 and (staged or sequence_split):
            other = "pipeline.stages" if staged else "sequence_parallel_size"
            problems.append(
                (
                    f"tensor_parallel.autotp_size, {other}",
                    "AutoTP tensor parallelism runs with ZeRO 0-3 and data parallelism, not with "
                    + (
                        "pipeline stages"
                        if staged
                        else "Ulysses sequence parallelism (both split consecutive ranks)"
                    ),
                )
            )
        if expert_size(self) > 1 and (staged or sequence_split or tensor_size(self) > 1):
            other = (
                "pipeline.stages"
                if staged
                else "sequence_parallel_size"
                if sequence_split
                else "tensor_parallel.autotp_size"
            )
            problems.append(
                (
                    f"expert_parallel.autoep_size, {other}",
                    "AutoEP expert parallelism runs with ZeRO 0-3 and data parallelism here, not with "
                    "pipeline stages, sequence or tensor parallelism",
                )
            )
        optimizer = self.optimizer
        if (
            optimizer is not None
            and stage >= 1
            and optimizer.type not in ZERO_TESTED_OPTIMIZERS
            and not self.zero_allow_untested_optimizer
        ):
            problems.append(
                (
                    "optimizer.type, zero_allow_untested_optimizer",
                    f"ZeRO refuses {optimizer.type} unless zero_allow_untested_optimizer is true "
                    f"(tested: {', '.join(ZERO_TESTED_OPTIMIZERS)})",
                )
            )
        offloaded = self.zero_optimization and self.zero_optimization.offload_optimizer
        if optimizer is not None and optimizer.type == "Lamb" and offloaded and offloaded.device != "none":
            problems.append(("optimizer.type, zero_optimization.offload_optimizer.device", OFFLOAD_NOTE))
        if (
            optimizer is not None
            and optimizer.type == "Lamb"
            and self.fp16 is not None
            and self.fp16.loss_scale > 0
        ):
            problems.append(
                (
                    "optimizer.type, fp16.loss_scale",
                    "DeepSpeed's Lamb needs dynamic loss scaling (fp16.loss_scale 0)",
                )
            )
        if problems:
            raise rule_error(problems)
        return self


def batch_problems(config: DSConfig, world_size: int) -> list[Problem]:
    """DeepSpeed's batch rule, train_batch = micro × accumulation × data-parallel size, checked early."""
    stages = config.pipeline.stages if config.pipeline and config.pipeline.stages else 1
    return _batch_arithmetic(
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        stages,
        world_size,
        config.sequence_parallel_size or 1,
        tensor_size(config),
    )


def expert_size(config: DSConfig) -> int:
    """The ranks AutoEP splits each MoE layer's experts over (1: off)."""
    section = config.expert_parallel
    return section.autoep_size if section is not None and section.enabled else 1


def tensor_size(config: DSConfig) -> int:
    """The ranks AutoTP splits each layer over (1: off; DeepSpeed reads 0 as off too)."""
    return max(config.tensor_parallel.autotp_size, 1) if config.tensor_parallel else 1


def _batch_arithmetic(
    tbs: int | None, mbs: int | None, gas: int | None, stages: int, world_size: int, sp: int = 1, tp: int = 1
) -> list[Problem]:
    """Given only two of the three, DeepSpeed infers the third with integer division and then fails
    its own assertion: 8 = 2 × g × 3 has no integer g. We report that case as such. The ranks of a
    sequence- or tensor-parallel group share their rows, so they count once in the data-parallel size."""
    if world_size < 1:
        return [("world_size", f"must be at least 1, got {world_size}")]
    if world_size % stages:
        return [("pipeline.stages", f"world size {world_size} is not divisible by {stages} pipeline stages")]
    if world_size % sp:
        return [("sequence_parallel_size", f"world size {world_size} is not divisible by {sp}")]
    if world_size % (sp * tp):
        return [("tensor_parallel.autotp_size", f"world size {world_size} is not divisible by {tp}")]
    dp = world_size // stages // sp // tp
    where = f"at data-parallel world size {dp}"
    if tbs is None and mbs is None:
        return [
            (
                "train_batch_size, train_micro_batch_size_per_gpu",
                "give at least one; DeepSpeed needs it to size batches",
            )
        ]
    if tbs is None:
        return []
    if mbs is not None and gas is not None:
        if tbs == mbs * gas * dp:
            return []
        return [
            (
                BATCH_KEYS,
                f"{tbs} != {mbs} × {gas} × {dp}; train_batch_size must equal micro batch × accumulation steps "
                f"× data-parallel world size = {mbs * gas * dp} {where}",
            )
        ]
    if mbs is not None:
        if tbs % (mbs * dp) == 0:
            return []
        return [
            (
                "train_batch_size, train_micro_batch_size_per_gpu",
                f"{tbs} = {mbs} × g × {dp} has no integer solution for gradient_accumulation_steps g {where}",
            )
        ]
    gas_value = gas if gas is not None else 1
    if tbs % (gas_value * dp) == 0:
        return []
    keys = "train_batch_size, gradient_accumulation_steps" if gas is not None else "train_batch_size"
    return [
        (
            keys,
            f"{tbs} = m × {gas_value} × {dp} has no integer solution for train_micro_batch_size_per_gpu m {where}",
        )
    ]


def _raw_batch_problems(data: dict[str, Any], world_size: int) -> list[Problem]:
    """The batch rule on the raw values, so a config with other errors still hears about its batch."""

    def positive_int(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    values = [
        data.get(k)
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    ]
    if any(v is not None and positive_int(v) is None for v in values):
        return []  # the schema already reports the bad value
    pipeline = data.get("pipeline")
    stages = positive_int(pipeline.get("stages")) if isinstance(pipeline, dict) else None
    tbs, mbs, gas = (positive_int(v) for v in values)
    sp = positive_int(data.get("sequence_parallel_size"))
    tensor = data.get("tensor_parallel")
    tp = positive_int(tensor.get("autotp_size")) if isinstance(tensor, dict) else None
    return _batch_arithmetic(tbs, mbs, gas, stages or 1, world_size, sp or 1, tp or 1)


def validate(data: Any, world_size: int | None = None) -> DSConfig:
    """Validate a DeepSpeed config dict; with a world size, also its batch arithmetic.

    Raises ConfigError listing every problem as ``key.path: message``.
    """
    if not isinstance(data, dict):
        raise ConfigError([("", f"a DeepSpeed config must be a JSON object, got {type(data).__name__}")])
    try:
        config = DSConfig.model_validate(data)
    except ValidationError as err:
        problems = problems_from_error(err, DSConfig)
        if world_size is not None:
            problems += _raw_batch_problems(data, world_size)
        raise ConfigError(dedupe(problems)) from None
    if world_size is not None:
        problems = batch_problems(config, world_size)
        if problems:
            raise ConfigError(dedupe(problems))
    return config
