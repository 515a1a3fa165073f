"""A DeepSpeed-based trainer for large language models.

``from trainer import Trainer, TrainingArguments`` mirrors HF Transformers. Heavy modules (torch,
deepspeed) load on first use, so ``trainer.config`` and the config CLI stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.runtime import import_guard

import_guard.install()

__version__ = "0.1.0"
__all__ = [
    "CPOConfig",
    "CPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "ORPOConfig",
    "ORPOTrainer",
    "SFTConfig",
    "SFTTrainer",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
]

_LAZY = {
    "CPOConfig": "trainer.args.preference",
    "CPOTrainer": "trainer.loop.preference",
    "DPOConfig": "trainer.args.preference",
    "DPOTrainer": "trainer.loop.dpo",
    "ORPOConfig": "trainer.args.preference",
    "ORPOTrainer": "trainer.loop.preference",
    "SFTConfig": "trainer.args.trl",
    "SFTTrainer": "trainer.loop.sft",
    "Trainer": "trainer.loop.trainer",
    "TrainingArguments": "trainer.args",
    "Seq2SeqTrainer": "trainer.loop.seq2seq",
    "Seq2SeqTrainingArguments": "trainer.args",
    "TrainerCallback": "trainer.runtime.state",
    "TrainerControl": "trainer.runtime.state",
    "TrainerState": "trainer.runtime.state",
}

if TYPE_CHECKING:
    from trainer.args import Seq2SeqTrainingArguments, TrainingArguments
    from trainer.args.preference import CPOConfig, DPOConfig, ORPOConfig
    from trainer.args.trl import SFTConfig
    from trainer.loop.dpo import DPOTrainer
    from trainer.loop.preference import CPOTrainer, ORPOTrainer
    from trainer.loop.seq2seq import Seq2SeqTrainer
    from trainer.loop.sft import SFTTrainer
    from trainer.loop.trainer import Trainer
    from trainer.runtime.state import TrainerCallback, TrainerControl, TrainerState


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        with import_guard.heavy_imports():
            value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # loaded once: the next use does not come back here
        return value
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
