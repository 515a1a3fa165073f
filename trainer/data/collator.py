"""Batching rows into tensors: the causal-LM padder, and the Trainer's default collator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import (
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
    SequenceFeatureExtractor,
    default_data_collator,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model

from trainer.data.processing import IGNORE_INDEX

# Class names transformers' AutoModelForCausalLM builds: the models whose default collator is ours.
CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm(model: Any) -> bool:
    """A model transformers lists as a causal LM (a peft wrapper answers for its base model)."""
    return type(unwrap_peft_model(model)).__name__ in CAUSAL_LM_CLASSES


def default_collator_for(model: Any, processing_class: Any) -> Callable[[list[dict[str, Any]]], Any]:
    """The collator a Trainer given none uses, as HF's picks it: ``DataCollatorWithPadding`` for a
    tokenizer (or an audio feature extractor), else ``default_data_collator`` (image processors,
    none). A causal LM is the exception: ``CausalLMCollator`` makes its labels from ``input_ids``
    (HF's default would leave it without labels, so HF users add a collator that does this) and
    keeps the default training job's batches what they were."""
    if is_causal_lm(model):
        return default_collator(processing_class)
    if isinstance(processing_class, PreTrainedTokenizerBase | SequenceFeatureExtractor):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def default_collator(tokenizer: Any) -> CausalLMCollator:
    """A causal LM's default collator: pad with the tokenizer's pad (else EOS, else 0)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None) or 0
    return CausalLMCollator(pad_token_id=pad)


class CausalLMCollator:
    """Pads a list of rows on the right to the longest row of the batch.

    Each row has ``input_ids`` and optionally ``labels`` (SFT: -100 on the prompt) and
    ``position_ids`` (packed blocks). The batch holds ``input_ids`` (padded with
    ``pad_token_id``), ``attention_mask`` (1 on real tokens), ``labels`` (the row's labels, else a
    copy of ``input_ids``; -100 on every padding position) and, when the rows carry them,
    ``position_ids`` (0 on padding). Padding is recognised by position, never by token id, so a
    tokenizer whose pad token is its EOS keeps EOS in the loss.

    ``pad_to_multiple_of`` rounds the padded length up (tensor-core friendly shapes on GPUs).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        lengths = [len(r["input_ids"]) for r in rows]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
            "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
        }
        with_positions = "position_ids" in rows[0]
        if with_positions:
            batch["position_ids"] = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            batch["input_ids"][i, :n] = ids
            batch["attention_mask"][i, :n] = 1
            labels = row.get("labels")
            batch["labels"][i, :n] = ids if labels is None else torch.as_tensor(labels, dtype=torch.long)
            if with_positions:
                batch["position_ids"][i, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
        return batch


# SFT rows carry their own masked labels, which the causal-LM collator already honours.
SFTCollator = CausalLMCollator


def non_padding_tokens(batch: dict[str, Any]) -> Any:
    """Tokens of a batch that are not padding: the attention mask's sum, else every input id; a
    batch of no token ids (an image classifier's ``pixel_values``) has none.

    Returns a tensor on the batch's device (summing it does not synchronise); pass it to
    ``StepTimer.step_end`` as is.
    """
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    ids = batch.get("input_ids")
    return ids.numel() if ids is not None else 0


def input_ids_count(batch: dict[str, Any]) -> int:
    """Every input id of a batch, padding too: what HF's ``include_num_input_tokens_seen="all"`` counts."""
    ids = batch.get("input_ids")
    return ids.numel() if ids is not None else 0
