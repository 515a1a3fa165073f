"""The run's arguments: ``TrainingArguments`` (``training``), ``RunConfig`` (``run``), their field groups
(``base``, ``model_data``), HF's fields and how each is honoured or refused (``hf``, ``hf_fields``),
and recipes and the command line (``recipe``).
"""

from trainer.args.run import RunConfig
from trainer.args.training import (
    DataArguments,
    ModelArguments,
    Seq2SeqTrainingArguments,
    TrainingArguments,
)

__all__ = ["DataArguments", "ModelArguments", "RunConfig", "Seq2SeqTrainingArguments", "TrainingArguments"]
