"""The data pipeline: raw documents -> tokens -> packed blocks -> batches, in a resumable order.

``get_tokenizer`` loads or trains the tokenizer, ``build_datasets`` returns cached (train, eval)
datasets, ``model_columns`` keeps the columns a model takes (HF's ``remove_unused_columns``),
``default_collator_for`` picks the collator HF's Trainer would (``CausalLMCollator`` for a causal LM)
and ``ResumableDistributedSampler`` orders and shards them so a resumed run continues exactly where
it stopped. See docs/data.md.
"""

from trainer.data.build import PreparedData, build_datasets, prepare_datasets
from trainer.data.chat import DEFAULT_CHAT_TEMPLATE, IGNORE_INDEX
from trainer.data.collator import (
    CausalLMCollator,
    SFTCollator,
    default_collator,
    default_collator_for,
)
from trainer.data.columns import model_columns
from trainer.data.formats import FORMAT_COLUMNS, resolve_format
from trainer.data.sampler import ResumableDistributedSampler
from trainer.data.sources import DataError, corpus_files, default_cache_root
from trainer.data.tokenizer import get_tokenizer, train_bpe_tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "FORMAT_COLUMNS",
    "IGNORE_INDEX",
    "CausalLMCollator",
    "DataError",
    "PreparedData",
    "ResumableDistributedSampler",
    "SFTCollator",
    "build_datasets",
    "corpus_files",
    "default_cache_root",
    "default_collator",
    "default_collator_for",
    "get_tokenizer",
    "model_columns",
    "prepare_datasets",
    "resolve_format",
    "train_bpe_tokenizer",
]
