"""TRL's preference configs, by TRL's names and defaults, on top of ``TRLConfig``:
``DPOConfig``, ``ORPOConfig`` and ``CPOConfig`` (whose ``loss_type="simpo"`` is SimPO).

Each TRL field is honoured with TRL's meaning, or refused by name when set to a value this trainer
does not implement yet (each class's ``REFUSED``), before anything is built. Where ours differs from
TRL's:
- DPO's reference log-probabilities are always computed once, before the first step, by the
  training engine itself (``precompute_ref_log_probs`` is accepted either way; the numbers are the
  same);
- every trainer tokenises pairs by ``DPOTrainer``'s rules (``trainer.data.preference``); TRL's ORPO
  and CPO trainers also put the BOS token in front of a text prompt whose tokenizer does not;
- ``bf16`` keeps this project's default (off; ``precision: auto`` picks bf16 on GPUs that have it),
  where TRL turns it on unless ``fp16`` is set.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import Field, field_validator, model_validator

from trainer.args.training import Objective
from trainer.args.trl import Refusals, TRLConfig
from trainer.objectives import names_for

LossType = Literal["sigmoid", "hinge", "ipo", "robust"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
CPOLossType = Literal["sigmoid", "hinge", "ipo", "simpo"]
CPO_LOSS_TYPES: tuple[str, ...] = get_args(CPOLossType)

ENCODER_DECODER: Refusals = {
    "max_completion_length": (None, "TRL reads it for encoder-decoder models only, which are not supported"),
    "is_encoder_decoder": (None, "encoder-decoder models are not supported; pairs train decoder-only models"),
    "generate_during_eval": (False, "sampling completions during evaluation is not implemented"),
}


class PreferenceConfig(TRLConfig):
    """The fields every preference trainer shares."""

    learning_rate: float = Field(1e-6, ge=0, description="Peak learning rate (TRL's default).")
    disable_dropout: bool = Field(True, description="Set every dropout probability of the model to 0.")
    beta: float = Field(0.1, gt=0, description="The preference term's temperature or weight.")
    padding_free: bool = Field(
        False,
        description="Forward a micro-batch's sequences end to end in one row, without padding, each "
        "attending to itself alone (TRL's DPO field; here for every preference objective).",
    )


class DPOConfig(PreferenceConfig):
    """TRL's ``DPOConfig`` fields: the reference and the loss."""

    OBJECTIVES: ClassVar[tuple[str, ...]] = names_for(f"{__name__}:DPOConfig")
    objective: Objective = Field(
        OBJECTIVES[0], description="dpo: what scripts/train.py runs with these fields."
    )

    REFUSED: ClassVar[Refusals] = {
        "ld_alpha": (None, "length-desensitised DPO (LD-DPO) is not implemented"),
        "f_divergence_type": ("reverse_kl", "only the reverse KL (standard DPO) is implemented"),
        "use_weighting": (False, "WPO weighting is not implemented"),
        "sync_ref_model": (False, "the reference is computed once before the first step, never synced"),
        "router_aux_loss_coef": (None, "the MoE router's auxiliary loss is not added"),
        "activation_offloading": (False, "use offload_activations with the tiled loss instead"),
        "pad_token": (None, "set tokenizer.pad_token and pass the tokenizer as processing_class"),
    }

    precompute_ref_log_probs: bool = Field(
        False, description="Accepted for TRL's scripts: the reference is always computed once, before step 0."
    )
    precompute_ref_batch_size: int | None = Field(
        None, ge=1, description="Pairs per forward of the reference pass; default per_device_eval_batch_size."
    )
    loss_type: list[LossType] = Field(
        ["sigmoid"], description="DPO loss types (TRL's names); several add up with loss_weights."
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type (default: 1 each).")
    beta: float = Field(
        0.1, gt=0, description="How far the policy may move from the reference (or IPO's tau)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="The robust loss's assumed rate of flipped preference labels."
    )
    ld_alpha: float | None = Field(None, description="Refused when set (REFUSED).")
    f_divergence_type: str = Field("reverse_kl", description="Refused unless reverse_kl (REFUSED).")
    f_alpha_divergence_coef: float = Field(0.5, description="Read only with an alpha divergence, refused.")
    use_weighting: bool = Field(False, description="Refused when true (REFUSED).")
    discopop_tau: float = Field(0.05, description="Read only by the discopop loss, which is not implemented.")
    activation_offloading: bool = Field(False, description="Refused when true (REFUSED).")
    sync_ref_model: bool = Field(False, description="Refused when true (REFUSED).")
    ref_model_mixup_alpha: float = Field(0.6, description="Read only with sync_ref_model, refused.")
    ref_model_sync_steps: int = Field(512, description="Read only with sync_ref_model, refused.")
    router_aux_loss_coef: float | None = Field(None, description="Refused when set (REFUSED).")
    pad_token: str | None = Field(None, description="Refused when set (REFUSED).")

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _weights(self) -> DPOConfig:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights: {len(self.loss_weights)} weights for {len(self.loss_type)} loss types; give one each"
            )
        return self


class ORPOConfig(PreferenceConfig):
    """TRL's ``ORPOConfig`` fields. ``beta`` is the paper's lambda: the odds-ratio term's weight."""

    REFUSED: ClassVar[Refusals] = ENCODER_DECODER
    OBJECTIVES: ClassVar[tuple[str, ...]] = names_for(f"{__name__}:ORPOConfig")
    objective: Objective = Field(
        OBJECTIVES[0], description="orpo: what scripts/train.py runs with these fields."
    )

    beta: float = Field(0.1, gt=0, description="The weight of the odds-ratio term (the paper's lambda).")
    padding_value: int | None = Field(
        None, description="The token id that pads; default the tokenizer's pad."
    )
    max_completion_length: int | None = Field(None, description="Refused when set (REFUSED).")
    is_encoder_decoder: bool | None = Field(None, description="Refused when set (REFUSED).")
    generate_during_eval: bool = Field(False, description="Refused when true (REFUSED).")


class CPOConfig(PreferenceConfig):
    """TRL's ``CPOConfig`` fields; ``loss_type="simpo"`` with ``cpo_alpha=0`` is SimPO."""

    REFUSED: ClassVar[Refusals] = {
        **ENCODER_DECODER,
        "alpha": (0.0, "AlphaPO's reward transformation is not implemented"),
    }
    OBJECTIVES: ClassVar[tuple[str, ...]] = names_for(f"{__name__}:CPOConfig")

    objective: Objective = Field(
        OBJECTIVES[0],
        description="cpo, or simpo: CPO's loss_type simpo without its NLL term (cpo_alpha 0) by default.",
    )

    beta: float = Field(0.1, gt=0, description="The temperature of the preference loss (IPO's tau).")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="The sigmoid and simpo losses' assumed rate of flipped labels."
    )
    loss_type: CPOLossType = Field("sigmoid", description="sigmoid, hinge, ipo or simpo (SimPO).")
    cpo_alpha: float = Field(1.0, ge=0, description="The weight of the chosen answers' NLL term.")
    simpo_gamma: float = Field(0.5, description="SimPO's target reward margin (loss_type simpo).")
    alpha: float = Field(0.0, description="Refused unless 0 (REFUSED).")
    max_completion_length: int | None = Field(None, description="Refused when set (REFUSED).")
    is_encoder_decoder: bool | None = Field(None, description="Refused when set (REFUSED).")
    generate_during_eval: bool = Field(False, description="Refused when true (REFUSED).")

    @model_validator(mode="before")
    @classmethod
    def _simpo(cls, data: Any) -> Any:
        """``objective: simpo`` is SimPO as its paper has it, unless a field says otherwise."""
        if isinstance(data, dict) and data.get("objective") == "simpo":
            data = {"loss_type": "simpo", "cpo_alpha": 0.0, **data}
            if data["loss_type"] != "simpo":
                raise ValueError(
                    f"objective, loss_type: simpo is CPO's loss_type simpo, not {data['loss_type']}; "
                    "use objective cpo for the other loss types"
                )
        return data


KTOLossType = Literal["kto", "apo_zero_unpaired"]


class KTOConfig(PreferenceConfig):
    """TRL's ``KTOConfig`` fields: unpaired completions, each labelled desirable or not, weighed
    against a reference and a KL estimate from mismatched completions (``loss_type`` kto)."""

    OBJECTIVES: ClassVar[tuple[str, ...]] = names_for(f"{__name__}:KTOConfig")
    objective: Objective = Field(
        OBJECTIVES[0], description="kto: what scripts/train.py runs with these fields."
    )

    REFUSED: ClassVar[Refusals] = {
        "truncation_mode": ("keep_start", "TRL's KTO keeps each sequence's start"),
        "padding_free": (False, "TRL's KTO pads its batches"),
        "sync_ref_model": (False, "the reference is computed once before the first step, never synced"),
        "router_aux_loss_coef": (None, "the MoE router's auxiliary loss is not added"),
        "activation_offloading": (False, "use offload_activations with the tiled loss instead"),
    }

    train_sampling_strategy: Literal["random", "sequential", "group_by_length"] = Field(
        "sequential",
        description="The set's order (TRL's KTO default): a row's KL completion comes from its neighbours.",
    )
    loss_type: KTOLossType = Field(
        "kto", description="kto (with the KL estimate) or apo_zero_unpaired (TRL's names)."
    )
    desirable_weight: float = Field(1.0, ge=0, description="The weight of a desirable completion's loss.")
    undesirable_weight: float = Field(
        1.0, ge=0, description="The weight of an undesirable completion's loss."
    )
    precompute_ref_log_probs: bool = Field(
        False, description="Accepted for TRL's scripts: the reference is always computed once, before step 0."
    )
    precompute_ref_batch_size: int | None = Field(
        None, ge=1, description="Rows per forward of the reference pass; default per_device_eval_batch_size."
    )
    activation_offloading: bool = Field(False, description="Refused when true (REFUSED).")
    sync_ref_model: bool = Field(False, description="Refused when true (REFUSED).")
    ref_model_mixup_alpha: float = Field(0.6, description="Read only with sync_ref_model, refused.")
    ref_model_sync_steps: int = Field(512, description="Read only with sync_ref_model, refused.")
    router_aux_loss_coef: float | None = Field(None, description="Refused when set (REFUSED).")

    @model_validator(mode="after")
    def _mismatched_pairs(self) -> KTOConfig:
        """As TRL: the KL estimate pairs each prompt with a neighbour's completion in the set's order."""
        if self.loss_type == "kto" and self.train_sampling_strategy != "sequential":
            raise ValueError(
                "train_sampling_strategy: loss_type kto builds its KL pairs from neighbouring rows, so the "
                f"set is read in order (sequential), not {self.train_sampling_strategy}"
            )
        if self.loss_type == "kto" and self.per_device_train_batch_size < 2:
            raise ValueError(
                "per_device_train_batch_size: loss_type kto pairs each prompt with another row's completion "
                "in its micro-batch, so it needs at least 2 rows"
            )
        return self
