"""``KTOTrainer``: TRL's KTO trainer on this project's loop and engine. A TRL KTO script ports by
changing its import (``from trainer import KTOConfig, KTOTrainer``).

Rows are unpaired completions: ``prompt``, ``completion`` and ``label`` (desirable or not), as text
or conversations. A preference set (``chosen``/``rejected``, its prompt explicit or implicit) is
unpaired as TRL unpairs it: in blocks of 1,000 rows, the block's chosen completions (labelled
desirable) and then its rejected ones. Each row is tokenised as TRL tokenises it (a text completion
ends with the EOS token), and rows whose prompt alone fills ``max_length`` are dropped.

Each row is laid out as a pair (``trainer.data.preference``): its completion, and its KL partner, the
completion of the row before it within its global micro-batch (the first row takes the last one's),
as TRL rotates completions within each micro-batch of a set read in order. The global micro-batch
is ``per_device_train_batch_size`` rows on each of the mesh's readers, so the pairs, the KL estimate
and the loss are the same on any number of ranks; on one process they are TRL's. The reference
scores both sequences of every row once, before the first step, as DPO's does (``DPOTrainer``): the
initial policy, the base with its adapters off, or ``ref_model``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.args.preference import KTOConfig
from trainer.data.preference import PAIR_COLUMNS, split_prompt, tokenize_pair
from trainer.loop.dpo import DPOTrainer
from trainer.loop.stages import DataStage

UNPAIR_BLOCK = 1000  # TRL unpairs a preference set in blocks of this many rows
COMPLETION, PARTNER = PAIR_COLUMNS[1], PAIR_COLUMNS[2]  # a row's completion, its KL partner's


class KTOTrainer(DPOTrainer):
    """TRL's ``KTOTrainer`` arguments (TRL's order: the model, the reference, then the rest); ``args``
    is a ``KTOConfig``."""

    config_class = KTOConfig

    def __init__(
        self,
        model: str | torch.nn.Module,
        ref_model: Any = None,
        args: KTOConfig | None = None,
        *rest: Any,
        **kwargs: Any,
    ):
        super().__init__(model, ref_model, args, *rest, **kwargs)
        if not isinstance(self.data_collator, LabelledRows):
            self.data_collator = LabelledRows(self.data_collator)
        self.stages.insert(0, KLPartners())  # fixed before the reference scores them

    @staticmethod
    def pairs(dataset: Any, name: str, args: KTOConfig, tokenizer: Any) -> Any:
        """Labelled completions as token ids (``prompt_ids``, the completion's ids, ``label``); a
        preference set is unpaired first. A set tokenised already is returned as it is."""
        if dataset is None or COMPLETION in (dataset.column_names or []):
            return dataset
        columns = list(dataset.column_names or [])
        if "chosen" in columns and "rejected" in columns:
            dataset = dataset.map(
                _unpaired,
                batched=True,
                batch_size=UNPAIR_BLOCK,
                remove_columns=columns,
                desc=f"Unpairing {name}",
            )
            columns = list(dataset.column_names)
        missing = [c for c in ("prompt", "completion", "label") if c not in columns]
        if missing:
            raise ValueError(
                f"the {name} set has no {' or '.join(missing)} column (columns: {', '.join(columns)}); "
                "a KTO set has prompt, completion and label, or chosen and rejected to unpair"
            )

        def one(row: dict[str, Any], index: int) -> dict[str, Any]:
            try:
                ids = tokenize_pair(
                    {"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"]},
                    tokenizer,
                )
            except ValueError as problem:
                raise ValueError(f"the {name} set's row {index}: {problem}") from None
            return {"prompt_ids": ids["prompt_ids"], COMPLETION: ids[COMPLETION], "label": bool(row["label"])}

        out = dataset.map(
            one,
            with_indices=True,
            remove_columns=columns,
            num_proc=args.dataset_num_proc,
            desc=f"Tokenizing {name} completions",
        )
        if args.max_length is not None:
            out = out.filter(
                lambda row: len(row["prompt_ids"]) < args.max_length, num_proc=args.dataset_num_proc
            )
        return out


def _unpaired(block: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A block of preference rows as its chosen completions (desirable), then its rejected ones."""
    rows = [dict(zip(block, values, strict=True)) for values in zip(*block.values(), strict=True)]
    split = [split_prompt(row) for row in rows]
    return {
        "prompt": [prompt for prompt, _, _ in split] * 2,
        "completion": [chosen for _, chosen, _ in split] + [rejected for _, _, rejected in split],
        "label": [True] * len(rows) + [False] * len(rows),
    }


def with_kl_partners(dataset: Any, micro_batch: int) -> Any:
    """``dataset`` with each row's KL partner: the completion of the row before it within its block
    of ``micro_batch`` rows (the block's first row takes its last row's), TRL's rotation."""

    def rotate(block: dict[str, list[Any]]) -> dict[str, list[Any]]:
        completions = block[COMPLETION]
        return {PARTNER: completions[-1:] + completions[:-1]}

    return dataset.map(rotate, batched=True, batch_size=micro_batch, desc="Pairing KL completions")


class KLPartners(DataStage):
    """Each row's KL partner, fixed by the mesh's global micro-batch (``with_kl_partners``)."""

    def prepare(self, trainer: Any, dataset: Any, name: str | None) -> Any:
        if dataset is None or PARTNER in dataset.column_names:
            return dataset
        return with_kl_partners(dataset, trainer.args.per_device_train_batch_size * trainer.mesh.readers)


class LabelledRows:
    """A pair collator's batch with each row's ``label`` (desirable or not) beside it."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]):
        self.collate = collate

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {**self.collate(rows), "label": torch.tensor([bool(row["label"]) for row in rows])}
