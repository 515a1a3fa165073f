"""HF's ``Seq2SeqTrainer`` on our engine: evaluation and prediction that generate.

With ``predict_with_generate``, ``evaluate`` and ``predict`` still compute the loss with a plain
forward, and the predictions are the model's ``generate`` output (token ids), each batch padded to
the generation config's ``max_length`` with the pad token, its labels likewise, as HF's
``Seq2SeqTrainer`` pads them. Generation arguments come from the call (``max_length``,
``num_beams``, ...), else ``generation_max_length``/``generation_num_beams``, else the model's
generation config (``args.generation_config`` replaces it when given).

The evaluation loss of a model's own loss is HF's ``Seq2SeqTrainer``'s: the mean of its batches'
mean losses, each batch counted alike (a short last batch too); a causal LM's stays token-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.trainer_utils import PredictionOutput

from trainer.loop.trainer import Trainer


class Seq2SeqTrainer(Trainer):
    # HF's Seq2SeqTrainer gathers evaluation losses with plain ``gather`` ("we don't want to drop
    # samples"): a short last batch's mean keeps all ``eval_batch_size`` repeats, so each batch's
    # mean loss weighs alike where HF's Trainer weighs it by its rows.
    eval_per_batch = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._gen_kwargs: dict[str, Any] = {}
        config = getattr(self.args, "generation_config", None)
        if config is not None:
            self.model.generation_config = (
                config if isinstance(config, GenerationConfig) else _load_generation_config(config)
            )

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def _generation_kwargs(self, given: dict[str, Any]) -> dict[str, Any]:
        """The call's generation arguments, the run's arguments filling what it leaves out (HF's order)."""
        kwargs = dict(given)
        if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None:
            kwargs["max_length"] = getattr(self.args, "generation_max_length", None)
        if kwargs.get("num_beams") is None:
            kwargs["num_beams"] = getattr(self.args, "generation_num_beams", None)
        return {k: v for k, v in kwargs.items() if v is not None}

    def generation(self) -> Callable[[dict[str, torch.Tensor]], Any] | None:
        if not getattr(self.args, "predict_with_generate", False) or self.args.prediction_loss_only:
            return None
        return self._generate

    def _generate(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(generated ids, labels), each padded to the generation config's length as HF's are."""
        inputs = dict(batch)
        labels = inputs.get("labels")
        # decoder_input_ids made from the labels would make generate continue them: left out.
        if (
            labels is not None
            and "decoder_input_ids" in inputs
            and inputs["decoder_input_ids"].shape == labels.shape
        ):
            inputs.pop("decoder_input_ids")
            inputs.pop("decoder_attention_mask", None)
        generated = self.engine.generate(inputs, **self._gen_kwargs)
        config = self.engine.module.generation_config
        config.update(**config._get_default_generation_params(), defaults_only=True)
        return self._pad(generated, config), None if labels is None else self._pad(labels, config)

    def _pad(self, tensor: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
        """``tensor`` right-padded with the pad token to the config's ``max_length`` (else to
        ``max_new_tokens + 1``), as HF's Seq2SeqTrainer pads generated ids and labels."""
        length = config.max_length
        if tensor.shape[-1] >= length and config.max_new_tokens is not None:
            length = config.max_new_tokens + 1
        if tensor.shape[-1] >= length:
            return tensor
        tokenizer = self.processing_class
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        if pad is None:
            raise ValueError("predict_with_generate: set pad_token_id in the model config or the tokenizer")
        padded = torch.full((tensor.shape[0], length), pad, dtype=tensor.dtype, device=tensor.device)
        padded[:, : tensor.shape[-1]] = tensor
        return padded


def _load_generation_config(path: str) -> GenerationConfig:
    """``generation_config`` given as a local directory or file (no hub access is needed)."""
    target = Path(path)
    if target.is_file():
        return GenerationConfig.from_pretrained(target.parent, config_file_name=target.name)
    return GenerationConfig.from_pretrained(path)
