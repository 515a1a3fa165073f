"""``RunConfig``: a whole run, its training, model and data arguments validated together, built
from one flat mapping of a recipe and its flags (``from_flat``).

``objective`` picks the training arguments' class: ``TrainingArguments`` for the next-token loss,
and for a preference objective (``dpo``, ``orpo``, ``cpo``, ``simpo``) the TRL config that holds its
fields (``trainer.args.preference``). Every other key belongs to exactly one of the three sections;
an unknown key is an error that names it and suggests the nearest valid one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer.args.base import IN_RUN_CONFIG, ArgsModel, validation_problems
from trainer.args.model_data import DataArguments, ModelArguments
from trainer.args.training import TrainingArguments
from trainer.config.errors import ConfigError, unknown_key_message
from trainer.objectives import DEFAULT, OBJECTIVES, ROW_KINDS

SECTIONS: dict[str, type[ArgsModel]] = {
    "training": TrainingArguments,
    "model": ModelArguments,
    "data": DataArguments,
}


def training_class(objective: Any) -> type[TrainingArguments]:
    """The class whose fields describe ``objective`` (an unknown one is left to the field's check)."""
    entry = OBJECTIVES.get(objective) if isinstance(objective, str) else None
    return entry.config_class() if entry is not None else TrainingArguments


def _objective_hint(key: str, objective: Any) -> str | None:
    """For a key that belongs to other objectives than the run's: which ones."""
    others = [name for name, entry in OBJECTIVES.items() if key in entry.config_class().model_fields]
    if not others:
        return None
    return f"a field of objective {', '.join(others)}, not of {objective or DEFAULT}; set --objective"


# DeepSpeed 0.19.8 with peft's frozen experts; the engine refuses a LoRA model it is handed the same way.
LORA_WITH_EXPERT_PARALLEL = (
    "LoRA runs with ZeRO 0-3 and data parallelism, not with expert parallelism (DeepSpeed's ZeRO 1-2 "
    "and bf16 optimizers need an expert parameter that trains, and its ZeRO-3 checkpoints cannot hold "
    "frozen experts)"
)


class RunConfig(BaseModel):
    """A whole run: the three argument groups, validated together."""

    model_config = ConfigDict(extra="forbid")

    training: TrainingArguments = Field(default_factory=TrainingArguments)
    model: ModelArguments = Field(default_factory=ModelArguments)
    data: DataArguments = Field(default_factory=DataArguments)

    @model_validator(mode="after")
    def _lora_without_model_parallelism(self) -> RunConfig:
        if self.model.use_peft and self.training.pipeline_parallel_size > 1:
            raise ValueError(
                "use_peft: LoRA runs with ZeRO 0-3 and data parallelism, not with pipeline_parallel_size > 1 "
                "(the pipeline rebuilds the model from its layers, without peft's wrappers)"
            )
        if self.model.use_peft and self.training.tensor_parallel_size > 1:
            raise ValueError(
                "use_peft, tensor_parallel_size: LoRA runs with ZeRO 0-3 and data parallelism, not with "
                "tensor parallelism (AutoTP does not split peft's wrapped layers)"
            )
        if self.model.use_peft and self.training.expert_parallel_size > 1:
            raise ValueError(f"use_peft, expert_parallel_size: {LORA_WITH_EXPERT_PARALLEL}")
        return self

    @model_validator(mode="after")
    def _streams_of_documents(self) -> RunConfig:
        entry = OBJECTIVES[self.training.objective]
        if self.data.streaming and entry.data != "rows":
            raise ValueError(
                f"streaming, objective: {ROW_KINDS[entry.data]} ({entry.name}) are read up front, not "
                "streamed; set streaming false"
            )
        return self

    @model_validator(mode="after")
    def _rewards(self) -> RunConfig:
        """Online RL needs its reward functions; other objectives take none."""
        generates, funcs = OBJECTIVES[self.training.objective].data == "prompts", self.data.reward_funcs
        if generates and not funcs:
            raise ValueError(
                f"reward_funcs: objective {self.training.objective} scores its completions with reward functions; "
                "give them as module:function (or a reward model's path), comma-separated"
            )
        if funcs and not generates:
            raise ValueError(f"reward_funcs: objective {self.training.objective} generates nothing to reward")
        weights = getattr(self.training, "reward_weights", None)
        if funcs and weights is not None and len(weights) != len(funcs):
            raise ValueError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions")
        return self

    @model_validator(mode="after")
    def _sequence_split(self) -> RunConfig:
        sp, block = self.training.sequence_parallel_size, self.data.block_size
        if sp > 1 and self.training.pipeline_parallel_size > 1:
            raise ValueError(
                "sequence_parallel_size, pipeline_parallel_size: sequence parallelism runs with ZeRO 0-3 and "
                "data parallelism, not with pipeline stages"
            )
        if block % sp:
            raise ValueError(
                f"block_size, sequence_parallel_size: {block} tokens do not split over {sp} ranks; "
                f"use a block_size divisible by {sp}"
            )
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _as_sections(cls, data: Any, handler: Any) -> Any:
        token = IN_RUN_CONFIG.set(True)
        try:
            return handler(data)
        finally:
            IN_RUN_CONFIG.reset(token)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> RunConfig:
        """Build from one flat mapping of field -> value; each field is routed to its section (the
        training fields to the class ``objective`` names). A name two sections share (a preference
        config's ``trust_remote_code``, the model's too) goes to both."""
        sections = {**SECTIONS, "training": training_class(flat.get("objective"))}
        owners: dict[str, list[str]] = {}
        for section, model in sections.items():
            for name in model.model_fields:
                owners.setdefault(name, []).append(section)
        grouped: dict[str, dict[str, Any]] = {section: {} for section in sections}
        problems = []
        for key, value in flat.items():
            if key not in owners:
                problems.append(
                    (key, _objective_hint(key, flat.get("objective")) or unknown_key_message(key, owners))
                )
            else:
                for section in owners[key]:
                    grouped[section][key] = value
        if problems:
            raise ConfigError(problems)
        token = IN_RUN_CONFIG.set(True)
        try:
            return cls(**{**grouped, "training": sections["training"](**grouped["training"])})
        except ValidationError as err:
            raise ConfigError(validation_problems(err, SECTIONS)) from None
        finally:
            IN_RUN_CONFIG.reset(token)

    def to_flat(self) -> dict[str, Any]:
        return {
            k: v for section in (self.training, self.model, self.data) for k, v in section.to_dict().items()
        }
