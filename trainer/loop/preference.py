"""TRL's preference trainers on this project's loop and engine: ``ORPOTrainer`` and ``CPOTrainer``
here (reference-free), ``DPOTrainer`` in ``trainer.loop.dpo``. A TRL script ports by changing its
import (``from trainer import ORPOConfig, ORPOTrainer``).

``PreferenceTrainer`` holds what they share: a model given by name is loaded with the config's
``model_init_kwargs``, a ``peft_config`` wraps it in adapters, dropout is turned off
(``disable_dropout``), rows in TRL's preference formats are tokenised into pairs
(``trainer.data.preference``), and batches hold pairs, not rows cut to the model's columns. Each
trainer names its objective (``trainer.engine.preference``); the loop does not branch on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import set_seed

from trainer.args.preference import CPOConfig, ORPOConfig, PreferenceConfig
from trainer.args.trl import TRLConfig
from trainer.data.preference import (
    PAIR_COLUMNS,
    PreferenceCollator,
    tokenize_pair,
    tokenize_pair_with_bos,
    tokenize_preferences,
)
from trainer.engine.preference import PairObjective
from trainer.loop.trainer import Trainer
from trainer.objectives import OBJECTIVES
from trainer.observe.throughput import flops_per_token_for_model


class PreferenceTrainer(Trainer):
    """A Trainer over preference pairs; subclasses say which config they take and their objective."""

    config_class: type[PreferenceConfig] = PreferenceConfig
    tokenize_row: Callable[[dict[str, Any], Any], dict[str, list[int]]] = staticmethod(tokenize_pair)

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: PreferenceConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        peft_config: Any = None,
        quantization_config: Any = None,
        **kwargs: Any,
    ):
        """TRL's arguments; ``kwargs``: the Trainer's own (``run_config``, ``plan``: a run that
        ``trainer.loop.build`` builds)."""
        name, config = type(self).__name__, self.config_class
        args = args or config()
        if not isinstance(args, config):
            raise TypeError(f"{name}: args must be {config.__name__}, got {type(args).__name__}")
        set_seed(args.seed)  # as TRL: a peft_config's adapters are drawn from this state
        model, processing_class = load_model(model, args, processing_class, quantization_config)
        if processing_class is None:
            raise ValueError(f"{name}: give processing_class (the tokenizer) with a model object")
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if args.disable_dropout:
            disable_dropout(model)
        pad = getattr(args, "padding_value", None)
        pad = processing_class.pad_token_id if pad is None else pad
        pad = processing_class.eos_token_id if pad is None else pad
        if pad is None:
            raise ValueError(f"{name}: the tokenizer has neither a pad token nor an EOS token to pad with")
        super().__init__(
            model,
            args,
            train_dataset=self.pairs(train_dataset, "train", args, processing_class),
            eval_dataset=self.pairs(eval_dataset, "eval", args, processing_class),
            data_collator=data_collator
            or PreferenceCollator(
                pad, args.max_length, args.truncation_mode, args.pad_to_multiple_of, args.padding_free
            ),
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )

    @classmethod
    def pairs(cls, dataset: Any, name: str, args: PreferenceConfig, tokenizer: Any) -> Any:
        """A preference set as token ids, by the trainer's rule (``tokenize_row``); one already
        tokenised as it is."""
        if dataset is None or all(c in (dataset.column_names or []) for c in PAIR_COLUMNS):
            return dataset
        return tokenize_preferences(
            dataset,
            tokenizer,
            args.max_length,
            args.truncation_mode,
            name,
            args.dataset_num_proc,
            cls.tokenize_row,
        )

    def model_columns(self, dataset: Any, description: str | None = None) -> Any:
        """Tokenised (a set passed to ``evaluate`` may be raw rows), and kept whole: the pair collator
        reads the pairs' columns, not the model's forward arguments."""
        return self.pairs(dataset, description or "eval", self.args, self.processing_class)

    def make_objective(self) -> PairObjective:
        """The loss the registry names for the run's objective, built from its arguments."""
        return OBJECTIVES[self.args.objective].loss_class().from_args(self.args)

    def flops_per_token(self) -> float | None:
        """Both sequences of a pair are tokens the model reads: FLOPs per token at ``max_length``."""
        return flops_per_token_for_model(self.model, self.args.max_length or 1024, self.mesh.tensor)


class ORPOTrainer(PreferenceTrainer):
    """TRL's ``ORPOTrainer`` arguments; ``args`` is an ``ORPOConfig``. No reference model."""

    config_class = ORPOConfig
    tokenize_row = staticmethod(tokenize_pair_with_bos)  # TRL's ORPO keeps its older rule


class CPOTrainer(PreferenceTrainer):
    """TRL's ``CPOTrainer`` arguments; ``args`` is a ``CPOConfig`` (``loss_type="simpo"``: SimPO)."""

    config_class = CPOConfig
    tokenize_row = staticmethod(tokenize_pair_with_bos)  # TRL's CPO keeps its older rule


def load_model(
    model: str | torch.nn.Module, args: TRLConfig, processing_class: Any, quantization_config: Any = None
) -> tuple[torch.nn.Module, Any]:
    """A causal LM and its tokenizer by name or path, with the config's ``model_init_kwargs`` and
    TRL's ``quantization_config`` argument (as TRL, applied only to a model loaded here); a model
    object is returned as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    init_kwargs = dict(args.model_init_kwargs or {})
    if not isinstance(model, str):
        if quantization_config is not None:
            raise ValueError(
                "quantization_config: the model is already built, so it cannot be quantised here; "
                "give the model by name or path, or quantise it when you load it"
            )
        return model, processing_class
    if quantization_config is not None:
        if "quantization_config" in init_kwargs:
            raise ValueError(
                "quantization_config: given both as the trainer's argument and in model_init_kwargs; give it once"
            )
        init_kwargs["quantization_config"] = quantization_config
    kwargs = {"trust_remote_code": args.trust_remote_code, **init_kwargs}
    name = model
    model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    tokenizer = processing_class or AutoTokenizer.from_pretrained(
        name, trust_remote_code=args.trust_remote_code
    )
    return model, tokenizer


def is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def disable_dropout(model: torch.nn.Module | None) -> None:
    for module in model.modules() if model is not None else ():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
