"""``optimizer`` and ``scheduler``: a type plus the params that type takes.

DeepSpeed passes ``params`` straight to the optimizer or scheduler constructor, so a misspelled
param surfaces as a TypeError deep inside ``initialize`` (or, for a scheduler param that has a
default, not at all). Here each type has its own params model, checked when the config is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from trainer.config.base import ConfigModel, Problem, problems_from_error, rule_error
from trainer.config.errors import ConfigError

Betas = tuple[float, float]

_NOT_A_PARAM = (
    "not an optimizer parameter in DeepSpeed (it raises on it); use the top-level gradient_clipping"
)


def _check_betas(value: Betas) -> Betas:
    if not all(0 <= b < 1 for b in value):
        raise ValueError(f"each beta must be in [0, 1); got {list(value)}")
    return value


class _OptimizerParams(ConfigModel):
    key_hints = {"max_grad_norm": _NOT_A_PARAM}

    @field_validator("betas", mode="after", check_fields=False)
    @classmethod
    def _betas(cls, value: Betas) -> Betas:
        return _check_betas(value)

    @model_validator(mode="after")
    def _nesterov(self) -> _OptimizerParams:
        if getattr(self, "nesterov", False) and (self.momentum <= 0 or getattr(self, "dampening", 0) != 0):
            raise rule_error(
                [("nesterov, momentum, dampening", "Nesterov momentum needs momentum > 0 and dampening 0")]
            )
        return self


class AdamParams(_OptimizerParams):
    """Adam / AdamW: DeepSpeed's FusedAdam (DeepSpeedCPUAdam under CPU offload), or torch's with torch_adam."""

    lr: float = Field(1e-3, ge=0, description="Learning rate.")
    betas: Betas = Field(
        (0.9, 0.999), description="Coefficients of the running averages of the gradient and its square."
    )
    eps: float = Field(1e-8, gt=0, description="Term added to the denominator for stability.")
    weight_decay: float = Field(
        0.0, ge=0, description="Weight decay (decoupled in AdamW mode, L2 otherwise)."
    )
    torch_adam: bool = Field(
        False,
        description="Use torch.optim.AdamW/Adam instead of FusedAdam (bit-exact resume was seen with it).",
    )
    adam_w_mode: bool = Field(
        True,
        description="Decoupled weight decay (AdamW). type Adam defaults to it; false gives L2-regularised Adam.",
    )


class LambParams(_OptimizerParams):
    """LAMB: DeepSpeed's FusedLamb (GPU only)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate.")
    betas: Betas = Field(
        (0.9, 0.999), description="Coefficients of the running averages of the gradient and its square."
    )
    eps: float = Field(1e-8, gt=0, description="Term added to the denominator for stability.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")
    bias_correction: bool = Field(True, description="Apply Adam-style bias correction.")
    max_coeff: float = Field(10.0, gt=0, description="Upper bound of the layer-wise trust ratio.")
    min_coeff: float = Field(0.01, ge=0, description="Lower bound of the layer-wise trust ratio.")


class LionParams(_OptimizerParams):
    """Lion: FusedLion on GPU, DeepSpeedCPULion under CPU offload."""

    lr: float = Field(1e-4, ge=0, description="Learning rate (Lion wants about 3-10x less than AdamW).")
    betas: Betas = Field((0.9, 0.99), description="Interpolation and running-average coefficients.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")


class AdagradParams(_OptimizerParams):
    """Adagrad: torch.optim.Adagrad, DeepSpeedCPUAdagrad under CPU offload."""

    lr: float = Field(1e-2, ge=0, description="Learning rate.")
    eps: float = Field(1e-10, gt=0, description="Term added to the denominator for stability.")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty.")


class SGDParams(_OptimizerParams):
    """SGD: torch.optim.SGD (also MuSGD from the mup package)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate.")
    momentum: float = Field(0.0, ge=0, description="Momentum factor.")
    dampening: float = Field(0.0, ge=0, description="Dampening for momentum.")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty.")
    nesterov: bool = Field(False, description="Nesterov momentum; needs momentum > 0 and dampening 0.")


class MuAdamParams(_OptimizerParams):
    """MuAdam / MuAdamW from the mup package (muP-scaled learning rates)."""

    lr: float = Field(1e-3, ge=0, description="Learning rate.")
    betas: Betas = Field(
        (0.9, 0.999), description="Coefficients of the running averages of the gradient and its square."
    )
    eps: float = Field(1e-8, gt=0, description="Term added to the denominator for stability.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay.")


class MuonArgs(_OptimizerParams):
    """Muon's own settings (``optim muon``), given as HF's ``optim_args`` string; the run's
    learning_rate, weight_decay, adam_beta1/2 and adam_epsilon give the rest. Defaults are
    torch.optim.Muon's."""

    muon_lr: float | None = Field(None, ge=0, description="Learning rate of the Muon half (default: lr).")
    adam_lr: float | None = Field(
        None,
        ge=0,
        description="Learning rate of the AdamW half: embeddings, head, norms, biases (default: lr).",
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum.")
    nesterov: bool = Field(True, description="Orthogonalise Nesterov's look-ahead rather than the momentum.")
    ns_steps: int = Field(5, ge=1, lt=100, description="Newton-Schulz iterations per update.")
    update_scale: Literal["original", "match_rms_adamw"] = Field(
        "original",
        description="Scale of a (rows, cols) matrix's rate: original sqrt(max(1, rows/cols)), or Moonlight's "
        "match_rms_adamw 0.2 sqrt(max(rows, cols)), which lets Muon share AdamW's rate.",
    )
    ns_precision: Literal["bf16", "fp32"] | None = Field(
        None,
        description="What the iteration runs in; unset: bf16 (as torch's) on a GPU or where the run trains "
        "in bf16/fp16, fp32 elsewhere.",
    )


class MuonParams(MuonArgs):
    """Muon for the hidden matrices with AdamW for the rest: ours (trainer/engine/muon.py), built by
    the engine from this section and handed to DeepSpeed, exact under ZeRO 0-3 and accumulation."""

    key_hints = {
        **_OptimizerParams.key_hints,
        "ns_method": "the iteration here is torch.optim.Muon's quintic Newton-Schulz; set ns_steps or ns_precision",
        "torch_adam": "the AdamW half is always torch's AdamW step",
    }

    lr: float = Field(
        0.02, ge=0, description="Learning rate shared by both halves unless muon_lr / adam_lr is set."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay of both halves.")
    betas: Betas = Field((0.9, 0.999), description="Betas of the AdamW half.")
    eps: float = Field(1e-8, gt=0, description="Epsilon of the AdamW half.")


OPTIMIZER_PARAMS: dict[str, type[_OptimizerParams]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "Lamb": LambParams,
    "Lion": LionParams,
    "Adagrad": AdagradParams,
    "SGD": SGDParams,
    "MuAdam": MuAdamParams,
    "MuAdamW": MuAdamParams,
    "MuSGD": SGDParams,
    "Muon": MuonParams,
}
OptimizerType = Literal[
    "Adam", "AdamW", "Lamb", "Lion", "Adagrad", "SGD", "MuAdam", "MuAdamW", "MuSGD", "Muon"
]


class LarsParams(_OptimizerParams):
    """LARS's own settings (``optim lars``), given as HF's ``optim_args`` string; the rate and the
    decay are ``learning_rate`` and ``weight_decay``. Defaults are pytorch_optimizer's."""

    momentum: float = Field(0.9, ge=0, lt=1, description="Momentum.")
    dampening: float = Field(0.0, ge=0, le=1, description="Dampening of the momentum.")
    nesterov: bool = Field(False, description="Nesterov momentum.")
    trust_coefficient: float = Field(
        1e-3, ge=0, description="Scales each matrix's rate by this times |w| / (|g| + weight_decay |w|)."
    )


# The optimizers that read HF's optim_args, and the settings each takes there.
OPTIM_ARGS: dict[str, type[_OptimizerParams]] = {"lars": LarsParams, "muon": MuonArgs}


def optim_params(optim: str, optim_args: str | None) -> dict[str, Any]:
    """``optim_args`` ('momentum=0.9,trust_coefficient=0.001') as the keyword arguments of ``optim``
    (a key of OPTIM_ARGS); a key it does not take, or a bad value, is a ConfigError naming
    ``optim_args.<key>``."""
    pairs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (optim_args or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{item!r} is not key=value", path="optim_args")
        pairs[key.strip()] = value.strip()
    model = OPTIM_ARGS[optim]
    try:
        return model.model_validate(pairs).to_dict()
    except ValidationError as err:
        raise ConfigError(problems_from_error(err, model, prefix="optim_args")) from None


# Under optimizer offload DeepSpeed steps these with its own CPU kernels (DeepSpeedCPUAdam, -Adagrad,
# -Lion); SGD and the mup ones run as torch optimizers on the host; Lamb's fused GPU kernel cannot.
OFFLOAD_NATIVE = ("Adam", "AdamW", "Adagrad", "Lion")
OFFLOAD_NOTE = (
    "under optimizer offload DeepSpeed steps Adam/AdamW, Adagrad and Lion with its CPU kernels and SGD "
    "with torch's on the host, as it does lars and muon (from host memory; NVMe is refused for them); Lamb (a "
    "GPU kernel) is refused there"
)

# Optimizers DeepSpeed's ZeRO accepts without zero_allow_untested_optimizer.
ZERO_TESTED_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion", "Muon")


def _canonical(value: Any, names: Any) -> Any:
    """DeepSpeed matches some names case-insensitively and others exactly; we accept any case."""
    if isinstance(value, str):
        for name in names:
            if name.lower() == value.strip().lower():
                return name
    return value


def _validated_params(model: type[ConfigModel], params: dict[str, Any], type_name: str) -> dict[str, Any]:
    try:
        validated = model.model_validate(params)
    except ValidationError as err:
        problems = problems_from_error(err, model, prefix="params")
        raise rule_error(
            [
                (path, f"{msg} (for type {type_name})" if "unknown key" in msg else msg)
                for path, msg in problems
            ]
        ) from None
    return validated.to_dict()


class OptimizerConfig(ConfigModel):
    """The optimizer DeepSpeed builds. Leave the section out to pass your own optimizer to initialize."""

    type: OptimizerType = Field(
        description="Adam and AdamW (FusedAdam; CPU Adam under offload), Lamb, Lion, Adagrad, SGD, Muon, MuAdam, MuAdamW, MuSGD."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the optimizer; see the tables per type below."
    )

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        return _canonical(value, OPTIMIZER_PARAMS)

    @model_validator(mode="after")
    def _params(self) -> OptimizerConfig:
        self.params = _validated_params(OPTIMIZER_PARAMS[self.type], self.params, self.type)
        if self.type == "AdamW" and self.params.get("adam_w_mode") is False:
            raise rule_error(
                [
                    (
                        "params.adam_w_mode, type",
                        "adam_w_mode=false has no effect with type AdamW (DeepSpeed always decouples weight decay "
                        "for it); use type Adam for L2-regularised Adam",
                    )
                ]
            )
        return self


class WarmupLRParams(ConfigModel):
    """WarmupLR: warm up from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: float = Field(0.0, ge=0, description="Learning rate at step 0.")
    warmup_max_lr: float | None = Field(
        None, ge=0, description="Learning rate after warmup; unset uses the optimizer's lr."
    )
    warmup_num_steps: int = Field(1000, ge=1, description="Steps of warmup (DeepSpeed uses at least 2).")
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    warmup_max_lr: float | None = Field(0.001, ge=0, description="Learning rate after warmup.")
    total_num_steps: int = Field(ge=1, description="Step at which the learning rate reaches 0.")


class WarmupCosineLRParams(ConfigModel):
    """WarmupCosineLR: warm up to the optimizer's lr, then cosine decay; ratios are of that lr."""

    total_num_steps: int = Field(ge=1, description="Steps of the whole schedule.")
    warmup_min_ratio: float = Field(0.0, ge=0, le=1, description="Learning rate at step 0, as a ratio of lr.")
    warmup_num_steps: int = Field(1000, ge=1, description="Steps of warmup (DeepSpeed uses at least 2).")
    cos_min_ratio: float = Field(
        0.0001, ge=0, le=1, description="Learning rate at the end, as a ratio of lr."
    )
    warmup_type: Literal["log", "linear"] = Field("log", description="Shape of the warmup curve.")


class OneCycleParams(ConfigModel):
    """OneCycle: the 1cycle policy, with optional momentum cycling and post-cycle decay."""

    cycle_min_lr: float = Field(ge=0, description="Learning rate at the start and end of the cycle.")
    cycle_max_lr: float = Field(ge=0, description="Learning rate at the peak of the cycle.")
    decay_lr_rate: float = Field(0.0, ge=0, description="Learning-rate decay after the cycle.")
    cycle_first_step_size: int = Field(2000, ge=1, description="Steps of the rising half of the cycle.")
    cycle_second_step_size: int | None = Field(
        None, ge=1, description="Steps of the falling half (default: cycle_first_step_size)."
    )
    cycle_first_stair_count: int = Field(0, ge=0, description="Stairs in the rising half (0: continuous).")
    cycle_second_stair_count: int | None = Field(None, ge=0, description="Stairs in the falling half.")
    decay_step_size: int = Field(0, ge=0, description="Steps between decays after the cycle.")
    cycle_momentum: bool = Field(True, description="Cycle momentum opposite to the learning rate.")
    cycle_min_mom: float = Field(0.8, ge=0, lt=1, description="Lowest momentum.")
    cycle_max_mom: float = Field(0.9, ge=0, lt=1, description="Highest momentum.")
    decay_mom_rate: float = Field(0.0, ge=0, description="Momentum decay after the cycle.")

    @model_validator(mode="after")
    def _order(self) -> OneCycleParams:
        problems: list[Problem] = []
        if self.cycle_min_lr > self.cycle_max_lr:
            problems.append(
                (
                    "cycle_min_lr, cycle_max_lr",
                    f"cycle_min_lr {self.cycle_min_lr} is above cycle_max_lr {self.cycle_max_lr}",
                )
            )
        if self.cycle_min_mom > self.cycle_max_mom:
            problems.append(
                (
                    "cycle_min_mom, cycle_max_mom",
                    f"cycle_min_mom {self.cycle_min_mom} is above cycle_max_mom {self.cycle_max_mom}",
                )
            )
        if problems:
            raise rule_error(problems)
        return self


class LRRangeTestParams(ConfigModel):
    """LRRangeTest: raise the learning rate step by step to find a good range."""

    lr_range_test_min_lr: float = Field(1e-3, ge=0, description="Starting learning rate.")
    lr_range_test_step_size: int = Field(2000, ge=1, description="Steps between increases.")
    lr_range_test_step_rate: float = Field(1.0, gt=0, description="Increase per step_size.")
    lr_range_test_staircase: bool = Field(False, description="Increase in stairs instead of continuously.")


SCHEDULER_PARAMS: dict[str, type[ConfigModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
SchedulerType = Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]


class SchedulerConfig(ConfigModel):
    """The learning-rate schedule DeepSpeed steps with the optimizer."""

    type: SchedulerType = Field(
        description="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the schedule; see the tables per type below."
    )

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, value: Any) -> Any:
        return _canonical(value, SCHEDULER_PARAMS)

    @model_validator(mode="after")
    def _params(self) -> SchedulerConfig:
        self.params = _validated_params(SCHEDULER_PARAMS[self.type], self.params, self.type)
        total, warmup = self.params.get("total_num_steps"), self.params.get("warmup_num_steps", 1000)
        if total is not None and total < warmup:
            raise rule_error(
                [
                    (
                        "params.total_num_steps, params.warmup_num_steps",
                        f"total_num_steps {total} is less than warmup_num_steps {warmup}",
                    )
                ]
            )
        return self
