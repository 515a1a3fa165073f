"""What the config layer reads of a run's arguments.

``trainer.args`` imports ``trainer.config``, never the other way round: resolution and the presets
read the training arguments through these protocols, which ``trainer.args.TrainingArguments`` and
``RunConfig`` satisfy, and callers pass the arguments in (the defaults too, as ``TrainingArguments()``).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from trainer.config.zero import OffloadDevice


class TrainingArgs(Protocol):
    """The training arguments a DeepSpeed config mirrors (``trainer.args.TrainingArguments``)."""

    deepspeed: str | dict[str, Any] | None
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    pipeline_parallel_size: int
    sequence_parallel_size: int
    tensor_parallel_size: int
    expert_parallel_size: int
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    nvme_path: str | None
    optim: str
    optim_args: str | None
    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    lr_scheduler_type: str
    lr_scheduler_kwargs: dict[str, Any]
    max_steps: int
    warmup_steps: int
    warmup_ratio: float

    @property
    def model_fields_set(self) -> set[str]:
        """The fields set explicitly; only those override a DeepSpeed config's values."""
        ...

    @property
    def requested_precision(self) -> str: ...


class ModelArgs(Protocol):
    model_config_overrides: dict[str, Any]


class RunArgs(Protocol):
    """A whole run (``trainer.args.RunConfig``): its training and model arguments."""

    training: TrainingArgs
    model: ModelArgs


class Shortcuts(BaseModel):
    """The training arguments ``generate`` builds a config from, checked as ``TrainingArguments``
    checks them. Only the batch, precision and ZeRO steps of resolution read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    per_device_train_batch_size: int = Field(ge=1)
    gradient_accumulation_steps: int = Field(ge=1)
    zero_stage: Literal[0, 1, 2, 3]
    offload_optimizer: OffloadDevice
    offload_param: OffloadDevice
    nvme_path: str | None
    precision: Literal["auto", "fp32", "bf16", "fp16"]
    max_grad_norm: float = Field(ge=0)
    deepspeed: None = None  # the ZeRO section comes from the shortcuts
    pipeline_parallel_size: int = 1  # a generated config has no pipeline section
    sequence_parallel_size: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)

    @property
    def requested_precision(self) -> str:
        return self.precision
