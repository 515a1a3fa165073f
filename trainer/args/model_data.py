"""The model and data arguments of a run: which model to build or fine-tune (and LoRA, through
peft, with TRL's names), and which data to train on and how it is cut into blocks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.args.base import ArgsModel, json_object

# text: documents; sft: instruction data whose format is told from its columns; the rest name one.
DataFormat = Literal["text", "sft", "alpaca", "sharegpt", "messages", "prompt_completion", "prompt_response"]


# What only LoRA (use_peft) reads: refused away from its default without it.
LORA_FIELDS = (
    "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_modules_to_save", "use_rslora", "use_dora"
)  # fmt: skip


class ModelArguments(ArgsModel):
    model_name_or_path: str | None = Field(
        None,
        description="A local HF model directory (or hub name) to fine-tune; None builds from model_config.",
    )
    model_type: Literal["llama", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3"] = Field(
        "llama",
        description="Architecture built from model_config: a Llama, a GPT-2, or a mixture of experts "
        "(mixtral, qwen3_moe, deepseek_v3: 8 experts, 2 per token; deepseek_v3 adds a shared expert).",
    )
    model_config_overrides: dict[str, Any] | str | None = Field(  # str: JSON, for HF's parser
        default_factory=dict, description="Config fields for a model built from scratch (hidden_size, ...)."
    )
    tokenizer_name_or_path: str | None = Field(
        None,
        description="Tokenizer directory; None uses the model's, or trains a byte-level BPE on the corpus.",
    )
    vocab_size: int = Field(4096, ge=256, description="Vocabulary size of a tokenizer trained on the corpus.")
    trust_remote_code: bool = Field(False, description="Allow model code from the model directory to run.")
    # LoRA through peft (TRL's names): docs/finetuning.md.
    use_peft: bool = Field(
        False, description="Fine-tune LoRA adapters on the frozen model_name_or_path (peft)."
    )
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(
        32, ge=1, description="LoRA scaling numerator (alpha / r, or / sqrt(r) with rslora)."
    )
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    lora_target_modules: list[str] | None = Field(
        None,
        description="Modules that get adapters: names, or all-linear; None: peft's default for the model.",
    )
    lora_modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full and saved with the adapter (e.g. lm_head, embed_tokens)."
    )
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    use_dora: bool = Field(False, description="DoRA: weight-decomposed LoRA.")
    load_in_4bit: bool = Field(
        False, description="QLoRA: the frozen base in 4-bit NF4 through bitsandbytes (CUDA GPUs only)."
    )

    @field_validator("model_config_overrides", mode="before")
    @classmethod
    def _overrides_json(cls, value: Any) -> Any:
        return json_object(value)

    @field_validator("lora_target_modules", "lora_modules_to_save", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # a recipe's `all-linear`

    @model_validator(mode="after")
    def _lora_needs_a_base(self) -> ModelArguments:
        if self.use_peft and not self.model_name_or_path:
            raise ValueError(
                "use_peft: LoRA adapts an existing model; set model_name_or_path to its directory"
            )
        if self.load_in_4bit and not self.use_peft:
            raise ValueError("load_in_4bit: a 4-bit base cannot be trained in full; add use_peft (QLoRA)")
        if not self.use_peft:  # a LoRA setting without LoRA would be ignored: say so
            fields = type(self).model_fields
            changed = [n for n in LORA_FIELDS if getattr(self, n) != fields[n].default]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)}: LoRA settings without use_peft, which would train the whole "
                    "model and ignore them; add use_peft true, or drop them"
                )
        return self


# What only a stream reads: refused away from its default without streaming.
STREAM_FIELDS = ("stream_lanes", "stream_shuffle_window", "unreadable_shards", "data_changed")


class MixtureSource(ArgsModel):
    """One source of a streamed mixture (``dataset_mixture``): its files, weight and text column."""

    dataset: str = Field(description="A directory, a file, a glob of files, or 'stdlib'.")
    weight: float = Field(1.0, gt=0, description="Its share of the blocks, relative to the others' weights.")
    text_column: str = Field("text", description="The column holding its text (JSON lines and tables).")
    on_end: Literal["stop", "repeat", "drop"] = Field(
        "repeat",
        description="When a lane runs out of it: repeat (start it again, in a new order), stop (the run's "
        "data ends: every rank stops at the same step) or drop (the other sources share its weight).",
    )
    name: str | None = Field(None, description="Its name in logs and errors (default: the path's last part).")


class DataArguments(ArgsModel):
    dataset: str = Field(
        "stdlib",
        description="'stdlib' (the Python standard library source), a local file/dir, a directory written by "
        "save_to_disk, or a hub name.",
    )
    dataset_config: str | None = Field(None, description="Hub dataset configuration name.")
    reward_funcs: list[str] | None = Field(
        None,
        description="Online RL (objective grpo, rloo): the reward functions, as module:function (Python "
        "callables with TRL's signature) or reward models' paths; several comma-separated.",
    )
    text_column: str = Field("text", description="Column holding raw text.")
    data_format: DataFormat = Field(
        "text",
        description="text: causal LM on documents; sft: instruction data, its format told from the columns; "
        "or name it: alpaca, sharegpt, messages, prompt_completion, prompt_response (docs/data.md).",
    )
    block_size: int = Field(256, ge=8, description="Tokens per training sequence.")
    packing: bool = Field(
        True, description="Pack documents (or instruction rows) into blocks instead of padding each."
    )
    long_rows: Literal["error", "drop", "truncate"] = Field(
        "error",
        description="Instruction rows longer than block_size: an error naming them, dropped, or cut.",
    )
    validation_file: str | None = Field(
        None,
        description="Your own eval set (a file or directory, in the train data's format); "
        "no share of the train data is held out then.",
    )
    validation_split_percentage: float = Field(5.0, ge=0, lt=100, description="Share held out for eval.")
    max_train_samples: int | None = Field(
        None, ge=1, description="Truncate the training set (for quick runs)."
    )
    max_eval_samples: int | None = Field(
        None, ge=1, description="Truncate the evaluation set (for quick runs)."
    )
    preprocessing_num_workers: int | None = Field(None, ge=1, description="Processes for tokenisation.")
    # Streams (docs/data.md): read on the fly, mixed by weight, resumed exactly on any number of ranks.
    streaming: bool = Field(
        False,
        description="Stream the training data: files read, tokenised and packed as training goes, instead "
        "of tokenised up front; needs max_steps.",
    )
    dataset_mixture: list[MixtureSource] | None = Field(
        None,
        description="Several streamed sources mixed by weight, each {dataset, weight, text_column, on_end, "
        "name} (a recipe list, or the same as JSON on the command line); replaces dataset.",
    )
    stream_lanes: int = Field(
        64,
        ge=1,
        description="Canonical lanes a stream's rows are dealt to; the order depends on it (not on the world "
        "size), and a multiple of the data-parallel ranks reads each lane on one rank.",
    )
    stream_shuffle_window: int = Field(
        16,
        ge=1,
        description="A lane's blocks are shuffled this many at a time (1: no shuffle); a resume reads a "
        "lane's current window again, so it costs up to this many blocks a lane.",
    )
    unreadable_shards: Literal["stop", "skip"] = Field(
        "stop", description="A streamed file that cannot be read: stop with its path, or skip it (logged)."
    )
    data_changed: Literal["refuse", "ok"] = Field(
        "refuse",
        description="A resumed stream whose files changed (names, sizes, modification times): refused, or "
        "ok to go on from the checkpoint's cursors.",
    )
    cache_dir: str | None = Field(
        None, description="Tokenisation cache (default: ~/.cache/trainer/datasets)."
    )

    @field_validator("reward_funcs", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """``a:f,b:g`` on the command line: one name per comma."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("dataset_mixture", mode="before")
    @classmethod
    def _mixture_json(cls, value: Any) -> Any:
        if isinstance(value, str):  # the command line's JSON list
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"not a JSON list of sources: {err}") from None
        return value

    @model_validator(mode="after")
    def _mixtures_stream(self) -> DataArguments:
        if self.dataset_mixture and not self.streaming:
            raise ValueError("dataset_mixture: mixtures are streamed; add streaming true")
        fields = type(self).model_fields
        unused = [n for n in STREAM_FIELDS if getattr(self, n) != fields[n].default]
        if unused and not self.streaming:
            raise ValueError(
                f"{', '.join(unused)}: stream settings without streaming true, which would ignore them"
            )
        if self.streaming and self.max_train_samples:
            raise ValueError(
                "max_train_samples, streaming: a stream is not cut to a size; max_steps bounds the run"
            )
        return self
