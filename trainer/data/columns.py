"""Which dataset columns reach the model: HF's ``remove_unused_columns``.

HF's Trainer drops the columns a model's ``forward`` has no argument for, so raw text, ids and
other bookkeeping never reach the collator, while whatever the model does take (``token_type_ids``,
``pixel_values``, ``decoder_input_ids``, ``start_positions``, ...) does. The labels are kept under
every name HF's collators accept. This module applies the same rule, as a pure function of the
dataset, the model and the arguments.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import find_labels

logger = logging.getLogger(__name__)

# The names a label column may have: HF's default collator turns ``label``/``label_ids`` into ``labels``.
LABEL_COLUMNS = ("label", "label_ids")


def label_names(model: Any, args: Any) -> list[str]:
    """The label names HF's Trainer uses: ``args.label_names`` when set, else the ones the model's
    class names in its ``forward`` (``labels``; ``start_positions``/``end_positions`` for question
    answering); a peft wrapper answers for its base model."""
    names = getattr(args, "label_names", None)
    return list(names) if names is not None else find_labels(unwrap_peft_model(model).__class__)


def signature_columns(model: Any, args: Any) -> list[str]:
    """The columns a dataset keeps: the arguments of the (unwrapped) model's ``forward``, its label
    names, and ``label``/``label_ids``."""
    forward = inspect.signature(unwrap_peft_model(model).forward)
    return list(forward.parameters) + sorted(set(LABEL_COLUMNS) | set(label_names(model, args)))


def model_columns(dataset: Any, model: Any, args: Any, description: str | None = None) -> Any:
    """``dataset`` without the columns ``model`` cannot take, as HF's ``remove_unused_columns``.

    Left as it is: with ``args.remove_unused_columns`` false; when it has no ``column_names`` (a
    torch ``Dataset``, whose rows are the user's own); and when it has a transform set
    (``set_transform``/``with_transform``), whose rows are made on access from the columns listed,
    so dropping any of them would starve the transform. A dataset with no column the model takes is
    an error, since every batch would be empty."""
    if dataset is None or not getattr(args, "remove_unused_columns", True):
        return dataset
    names = getattr(dataset, "column_names", None)
    if names is None or _has_transform(dataset):
        return dataset
    keep = signature_columns(model, args)
    ignored = [c for c in names if c not in keep]
    if len(ignored) == len(names):
        raise ValueError(
            f"No columns in the dataset match the model's forward method signature: ({', '.join(keep)}). "
            f"The following columns have been ignored: [{', '.join(ignored)}]. Please check the dataset "
            "and model. You may need to set `remove_unused_columns=False` in `TrainingArguments`."
        )
    if not ignored:
        return dataset
    where = "" if description is None else f"in the {description} set"
    name = type(model).__name__
    logger.info(
        f"The following columns {where} don't have a corresponding argument in `{name}.forward` and have "
        f"been ignored: {', '.join(ignored)}. If {', '.join(ignored)} are not expected by "
        f"`{name}.forward`, you can safely ignore this message."
    )
    return dataset.remove_columns(ignored)


def _has_transform(dataset: Any) -> bool:
    """A ``datasets.Dataset`` whose rows come from a user transform (its format type is "custom")."""
    fmt = getattr(dataset, "format", None)
    return isinstance(fmt, dict) and fmt.get("type") == "custom"
