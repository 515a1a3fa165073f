"""``fp16``, ``bf16`` and ``data_types``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.config.base import ConfigModel, rule_error

DType = Literal["fp32", "fp16", "bf16"]

# Spellings DeepSpeed accepts for a dtype, mapped to the short one we write.
_DTYPE_SPELLINGS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def normalise_dtype(value: Any) -> Any:
    if isinstance(value, str):
        return _DTYPE_SPELLINGS.get(value.strip().lower(), value)
    return value


class FP16Config(ConfigModel):
    """fp16 mixed precision with loss scaling. Needs a GPU with compute capability 7.0 or newer."""

    enabled: bool = Field(False, description="Train in fp16 mixed precision.")
    auto_cast: bool = Field(False, description="Cast the model's floating-point inputs to fp16.")
    loss_scale: float = Field(
        0.0, ge=0, description="Static loss scale; 0 means dynamic loss scaling (recommended)."
    )
    initial_scale_power: int = Field(
        16, ge=0, le=64, description="Dynamic scaling starts at a loss scale of 2**initial_scale_power."
    )
    loss_scale_window: int = Field(
        1000, ge=1, description="Steps without overflow before the dynamic loss scale is raised."
    )
    hysteresis: int = Field(
        2, ge=1, description="Overflows tolerated before the dynamic loss scale is lowered."
    )
    consecutive_hysteresis: bool = Field(
        False, description="Refill the hysteresis counter after every step without overflow."
    )
    min_loss_scale: int = Field(1, ge=1, description="Lowest dynamic loss scale.")


class BF16Config(ConfigModel):
    """bf16 mixed precision. Needs an Ampere-or-newer GPU (or a CPU, where it is slow)."""

    enabled: bool = Field(False, description="Train in bf16 mixed precision.")
    immediate_grad_update: bool = Field(
        False, description="Apply gradient updates as soon as they are ready instead of at the step."
    )
    check_grad_overflow: bool = Field(
        True, description="Detect inf/nan gradients before the optimizer step and skip that step."
    )
    bf16_master_weights_and_grads: bool = Field(
        False, description="Keep ZeRO master weights and gradients in bf16 (needs ZeRO stage 1-3)."
    )
    bf16_optimizer_states: bool = Field(
        False, description="Keep optimizer states in bf16 (needs bf16_master_weights_and_grads)."
    )

    @model_validator(mode="after")
    def _states_need_master_weights(self) -> BF16Config:
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise rule_error(
                [
                    (
                        "bf16_optimizer_states, bf16_master_weights_and_grads",
                        "bf16 optimizer states need bf16_master_weights_and_grads: true",
                    )
                ]
            )
        return self


class DataTypesConfig(ConfigModel):
    """Data types of gradient accumulation, parameters and buffers."""

    grad_accum_dtype: DType | None = Field(
        None, description="Dtype gradients accumulate in; unset follows the training precision."
    )
    param_dtype: DType | None = Field(
        None, description="Dtype of the model parameters; unset keeps them as loaded."
    )
    buffer_dtype: DType | None = Field(
        None, description="Dtype of model buffers; unset keeps them as loaded."
    )
    keep_in_fp32_modules: list[str] | None = Field(
        None,
        description='Name patterns of modules kept in fp32 under bf16/fp16; unset lets DeepSpeed choose ("auto").',
    )

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalise_dtype(value)
