"""A DeepSpeed-based trainer for large language models.

``from trainer import Trainer, TrainingArguments`` mirrors HF Transformers. Heavy modules (torch,
deepspeed) load on first use, so ``trainer.config`` and the config CLI stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer import objectives
from trainer.runtime import import_guard

import_guard.install()

__version__ = "0.1.0"
# The objectives' arguments and Trainers come from the registry (trainer/objectives/); the rest here.
_LAZY = {
    **objectives.exports(),
    "SFTConfig": "trainer.args.trl",
    "SFTTrainer": "trainer.loop.sft",
    "Seq2SeqTrainer": "trainer.loop.seq2seq",
    "Seq2SeqTrainingArguments": "trainer.args",
    "TrainingArguments": "trainer.args",
    "TrainerCallback": "trainer.runtime.state",
    "TrainerControl": "trainer.runtime.state",
    "TrainerState": "trainer.runtime.state",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        with import_guard.heavy_imports():
            value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # loaded once: the next use does not come back here
        return value
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
