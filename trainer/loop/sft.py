"""TRL's ``SFTTrainer`` on this project's loop and engine: a TRL script ports by changing its import
(``from trainer import SFTConfig, SFTTrainer``).

The model may be given by name (loaded with the config's ``model_init_kwargs``) and wrapped in
``peft_config``'s adapters; the sets are prepared by TRL's rules (``trainer.data.sft``); the loss
and metrics are TRL's (``trainer.engine.sft.SFT``), token-exact over micro-batches and ranks
as every causal-LM run here. Not implemented, and refused by name: vision-language sets and
processors, ``compute_loss_func`` (TRL deprecates it: override ``compute_loss``),
``optimizer_cls_and_kwargs``, and a ``chat_template_path`` that is not a Jinja file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, set_seed

from trainer.args.training import TrainingArguments
from trainer.args.trl import SFTConfig
from trainer.data import CausalLMCollator
from trainer.data.sft import has_generation_marks, is_conversational, prepare_sft
from trainer.engine.objectives import Objective
from trainer.engine.sft import SFT
from trainer.loop.preference import is_peft, load_model
from trainer.loop.trainer import Trainer


class SFTTrainer(Trainer):
    """TRL's ``SFTTrainer`` arguments; ``args`` is an ``SFTConfig`` (a ``TrainingArguments`` is read as one)."""

    tokens_seen_key = "num_tokens"  # TRL's: the non-padding tokens trained so far, in every row

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: SFTConfig | TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict[str, Any]], str] | None = None,
        quantization_config: Any = None,
        **kwargs: Any,
    ):
        """TRL's arguments; ``kwargs``: the Trainer's own (``run_config``, ``plan``)."""
        args = sft_config(args)
        for name, value in (
            ("compute_loss_func", compute_loss_func),
            ("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs),
        ):
            if value is not None:
                raise ValueError(
                    f"SFTTrainer: {name} is not supported; override compute_loss, or pass optimizers=(optimizer, scheduler)"
                )
        if train_dataset is None:
            raise ValueError("SFTTrainer: train_dataset is required")
        set_seed(args.seed)  # as TRL: adapters are initialised from this state
        model, processing_class = load_model(model, args, processing_class, quantization_config)
        tokenizer = processing_class
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(
                f"SFTTrainer: processing_class must be a tokenizer (got {type(tokenizer).__name__}); "
                "vision-language processors are not supported"
            )
        set_special_tokens(model, tokenizer, args)
        sample = next(iter(train_dataset))
        if "image" in sample or "images" in sample:
            raise ValueError("SFTTrainer: vision-language sets (an image or images column) are not supported")
        if is_conversational(sample) and not tokenizer.chat_template:
            raise ValueError(
                "SFTTrainer: the rows are conversations and the tokenizer has no chat template to render "
                "them; give one (chat_template_path, a .jinja file), or use a tokenizer that has one"
            )
        if (
            args.assistant_only_loss
            and is_conversational(sample)
            and not has_generation_marks(tokenizer.chat_template)
        ):
            raise ValueError(
                "assistant_only_loss: the chat template has no {% generation %} ... {% endgeneration %} marks "
                "around the assistant's turns; give one that has them (chat_template_path)"
            )
        if peft_config is not None:
            if is_peft(model):
                raise ValueError(
                    "SFTTrainer: the model has adapters already; merge them before giving a peft_config"
                )
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if is_peft(model) and args.gradient_checkpointing:
            model.enable_input_require_grads()
        padding_free = args.padding_free or (args.packing and args.packing_strategy != "wrapped")
        if padding_free and data_collator is not None:
            raise ValueError(
                "SFTTrainer: a data_collator with padding-free batches (padding_free, or bfd packing)"
            )
        completion_only = args.completion_only_loss
        if completion_only is None:
            completion_only = "prompt" in sample and "completion" in sample
        if not (args.dataset_kwargs or {}).get("skip_prepare_dataset"):

            def prepare(dataset: Any, name: str, packing: bool) -> Any:
                return prepare_sft(dataset, tokenizer, args, name, packing, completion_only, formatting_func)

            eval_packing = args.packing if args.eval_packing is None else args.eval_packing
            train_dataset = prepare(train_dataset, "train", args.packing)
            if isinstance(eval_dataset, dict):
                eval_dataset = {key: prepare(d, key, eval_packing) for key, d in eval_dataset.items()}
            elif eval_dataset is not None:
                eval_dataset = prepare(eval_dataset, "eval", eval_packing)
        super().__init__(
            model,
            args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator or CausalLMCollator(tokenizer.pad_token_id, args.pad_to_multiple_of),
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            **kwargs,
        )

    def make_objective(self) -> Objective:
        """TRL's loss and metrics; a ``compute_loss`` override runs in its place, as the Trainer's."""
        if type(self).compute_loss is not Trainer.compute_loss:
            return super().make_objective()
        return SFT(self.args.loss_type, self.args.router_aux_loss_coef)


def sft_config(args: SFTConfig | TrainingArguments | None) -> SFTConfig:
    """``args`` as an ``SFTConfig``: a plain ``TrainingArguments`` keeps every value it holds, as TRL's."""
    if args is None:
        return SFTConfig()
    if isinstance(args, SFTConfig):
        return args
    if isinstance(args, TrainingArguments):
        return SFTConfig(**args.model_dump(exclude={"objective"}))
    raise TypeError(f"SFTTrainer: args must be SFTConfig or TrainingArguments, got {type(args).__name__}")


def set_special_tokens(model: torch.nn.Module, tokenizer: Any, args: SFTConfig) -> None:
    """TRL's: ``eos_token`` (the model's generation stops at it too), the pad token
    (``pad_token``, else the tokenizer's, else EOS) and a ``chat_template_path`` Jinja file."""
    vocab = tokenizer.get_vocab()
    if args.eos_token is not None:
        if args.eos_token not in vocab:
            raise ValueError(f"eos_token: {args.eos_token!r} is not in the tokenizer's vocabulary")
        tokenizer.eos_token = args.eos_token
        model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
        stops = model.generation_config.eos_token_id
        stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
        if tokenizer.eos_token_id not in stops:
            model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]
    pad = args.pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad not in vocab:
        raise ValueError(f"pad_token: {pad!r} is not in the tokenizer's vocabulary")
    tokenizer.pad_token = pad
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if args.chat_template_path is not None:
        path = Path(args.chat_template_path)
        if path.suffix not in (".jinja", ".j2") or not path.is_file():
            raise ValueError(
                f"chat_template_path: {path} is not a .jinja or .j2 file (copying a template, and its "
                "tokens, from another tokenizer is not supported)"
            )
        tokenizer.chat_template = path.read_text(encoding="utf-8")
