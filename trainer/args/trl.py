"""TRL's configs, by TRL's names and defaults, on top of ``TrainingArguments``: ``TRLConfig`` holds
what TRL's trainers share (the model by name, how sequences are cut), ``SFTConfig`` is TRL's
``SFTConfig``; the preference configs are in ``trainer.args.preference``.

Each TRL field is honoured with TRL's meaning, or refused by name when set to a value this trainer
does not implement (each class's ``REFUSED``), before anything is built. ``bf16`` keeps this
project's default (off; ``precision: auto`` picks bf16 on GPUs that have it), where TRL turns it on
unless ``fp16`` is set.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from trainer.args.training import TrainingArguments

Refusals = dict[str, tuple[Any, str]]  # field -> (the value that is implemented, why another is refused)


class TRLConfig(TrainingArguments):
    """The fields TRL's trainers share: the model given by name, and how sequences are tokenised and cut."""

    REFUSED: ClassVar[Refusals] = {}

    gradient_checkpointing: bool = Field(True, description="Activation checkpointing (TRL's default: on).")
    logging_steps: int = Field(10, ge=1, description="Log metrics every N optimizer steps (TRL's default).")
    model_init_kwargs: dict[str, Any] | None = Field(
        None, description="Keyword arguments for from_pretrained when the model is given by name."
    )
    trust_remote_code: bool = Field(False, description="Let from_pretrained run a model's own code.")
    dataset_num_proc: int | None = Field(None, ge=1, description="Processes that tokenise the data.")
    max_length: int | None = Field(
        1024, ge=1, description="Longest tokenised sequence; longer ones are cut (truncation_mode)."
    )
    truncation_mode: Literal["keep_start", "keep_end"] = Field(
        "keep_start", description="What a cut keeps of a sequence: its start or its end."
    )
    pad_to_multiple_of: int | None = Field(None, ge=1, description="Pad each batch to a multiple of this.")

    @model_validator(mode="after")
    def _implemented(self) -> TRLConfig:
        for name, (implemented, why) in self.REFUSED.items():
            if getattr(self, name) != implemented:
                raise ValueError(f"{name}={getattr(self, name)!r}: not supported ({why})")
        return self


class SFTConfig(TRLConfig):
    """TRL's ``SFTConfig`` fields (``trainer.loop.sft.SFTTrainer`` reads them)."""

    REFUSED: ClassVar[Refusals] = {
        "activation_offloading": (False, "use offload_activations with the tiled loss instead"),
    }

    learning_rate: float = Field(2e-5, ge=0, description="Peak learning rate (TRL's default).")
    chat_template_path: str | None = Field(
        None, description="A Jinja file (.jinja or .j2) whose template replaces the tokenizer's."
    )
    dataset_text_field: str = Field("text", description="The column of a language-modelling set's text.")
    dataset_kwargs: dict[str, Any] | None = Field(
        None, description="skip_prepare_dataset: true takes the sets as they are (already tokenised)."
    )
    eos_token: str | None = Field(
        None, description="The token that ends a text or turn; default the tokenizer's EOS."
    )
    shuffle_dataset: bool = Field(False, description="Shuffle the prepared set (before and after packing).")
    packing: bool = Field(False, description="Put several sequences into each row of max_length tokens.")
    packing_strategy: Literal["bfd", "bfd_split", "wrapped"] = Field(
        "bfd",
        description="bfd: best-fit decreasing, a sequence whole in one row (longer ones cut); bfd_split: "
        "longer ones split into several; wrapped: one stream cut every max_length tokens.",
    )
    padding_free: bool = Field(
        False, description="Batches without padding between sequences (implied by bfd packing)."
    )
    eval_packing: bool | None = Field(None, description="Pack the eval set; default: packing.")
    completion_only_loss: bool | None = Field(
        None,
        description="Train on the completion only; default: yes for prompt-completion rows, else every token.",
    )
    assistant_only_loss: bool = Field(
        False,
        description="Train on the assistant turns only, as the chat template's {% generation %} marks them.",
    )
    loss_type: Literal["nll", "dft"] = Field(
        "nll", description="nll, or dft: each token's NLL weighted by its (detached) probability."
    )
    activation_offloading: bool = Field(False, description="Refused when true (REFUSED).")
    pad_token: str | None = Field(
        None, description="The token that pads; default the tokenizer's pad, else EOS."
    )

    @field_validator("pad_to_multiple_of", mode="before")
    @classmethod
    def _auto(cls, value: Any) -> Any:
        """TRL's ``"auto"`` pads to a multiple of 128 on Neuron only: no padding here."""
        return None if isinstance(value, str) and value.lower() in ("auto", "none", "null") else value

    @field_validator("packing_strategy", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        return "bfd_split" if value == "bfd-requeue" else value  # TRL's old name

    @field_validator("loss_type", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return "nll" if value == "chunked_nll" else value  # TRL's alias of nll

    @model_validator(mode="after")
    def _packable(self) -> SFTConfig:
        if self.packing and self.max_length is None:
            raise ValueError("packing, max_length: packing needs max_length (the length of a packed row)")
        if self.padding_free and not self.packing and self.max_length is not None:
            raise ValueError(
                "padding_free, max_length: without packing, padding-free batches do not cut sequences; "
                "pack them (packing: true) or set max_length: null"
            )
        return self
