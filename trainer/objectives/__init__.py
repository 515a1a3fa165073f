"""The objectives a run can minimise, in one registry: the CLI's ``--objective``, the arguments'
``objective`` field, the package's exports, ``build_run``, the planner and ``trainer plan`` all read
it, so an objective's name is written here once.

An entry names its parts by import path, loaded on first use (``load``): the arguments class that
holds its fields, the Trainer that runs it (and prepares its data), and its loss, a class of the
engine's objective contract built from the arguments (``from_args``) whose ``metric_names`` are
what it logs besides the loss. ``data`` says what a row of its dataset is; ``reference`` whether it
scores a reference before training; ``sequences_per_row`` what one row forwards (the planner's
count). Nothing here imports torch: reading the names costs nothing.

Adding an objective: an entry here, its arguments class, its loss and its Trainer (or an existing
one). Nothing in the loop, the engine or the mesh changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

Rows = Literal["rows", "pairs", "unpaired", "prompts"]
ROW_KINDS = {
    "rows": "texts",
    "pairs": "preference pairs",
    "unpaired": "labelled completions",
    "prompts": "prompts the policy completes",
}


@dataclass(frozen=True)
class Entry:
    name: str
    summary: str
    config: str  # "module:Class": the arguments that hold its fields
    trainer: str  # "module:Class": the Trainer that runs it and prepares its data
    loss: str | None = None  # "module:Class": its loss (None: the model's own, chosen per model)
    data: Rows = "rows"  # a row: a text (tokens), a preference pair, a labelled completion, a prompt
    reference: bool = False  # scored against a frozen reference before training
    sequences_per_row: int = 1

    def config_class(self) -> Any:
        return load(self.config)

    def trainer_class(self) -> Any:
        return load(self.trainer)

    def loss_class(self) -> Any:
        return load(self.loss) if self.loss else None


def load(path: str) -> Any:
    """The object an import path ``module:Name`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


_PAIRS = {"data": "pairs", "sequences_per_row": 2}
_CPO = {
    "config": "trainer.args.preference:CPOConfig",
    "trainer": "trainer.loop.preference:CPOTrainer",
    "loss": "trainer.engine.preference:CPO",
    **_PAIRS,
}
OBJECTIVES: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry(
            "causal_lm",
            "the next-token loss",
            config="trainer.args.training:TrainingArguments",
            trainer="trainer.loop.trainer:Trainer",
        ),
        Entry(
            "dpo",
            "direct preference optimisation against a reference",
            config="trainer.args.preference:DPOConfig",
            trainer="trainer.loop.dpo:DPOTrainer",
            loss="trainer.engine.preference:DPO",
            reference=True,
            **_PAIRS,
        ),
        Entry(
            "orpo",
            "odds-ratio preference optimisation",
            config="trainer.args.preference:ORPOConfig",
            trainer="trainer.loop.preference:ORPOTrainer",
            loss="trainer.engine.preference:ORPO",
            **_PAIRS,
        ),
        Entry("cpo", "contrastive preference optimisation", **_CPO),
        Entry("simpo", "SimPO: CPO's simpo loss without its NLL term", **_CPO),
        Entry(
            "kto",
            "Kahneman-Tversky optimisation of labelled completions against a reference",
            config="trainer.args.preference:KTOConfig",
            trainer="trainer.loop.kto:KTOTrainer",
            loss="trainer.engine.preference:KTO",
            data="unpaired",
            reference=True,
            sequences_per_row=2,  # the completion and its KL partner
        ),
        Entry(
            "grpo",
            "group relative policy optimisation on completions the policy generates and rewards score",
            config="trainer.args.rl:GRPOConfig",
            trainer="trainer.loop.grpo:GRPOTrainer",
            loss="trainer.engine.rl:GRPO",
            data="prompts",
        ),
        Entry(
            "rloo",
            "REINFORCE leave-one-out on completions the policy generates and rewards score",
            config="trainer.args.rl:RLOOConfig",
            trainer="trainer.loop.grpo:RLOOTrainer",
            loss="trainer.engine.rl:RLOO",
            data="prompts",
        ),
    )
}
NAMES = tuple(OBJECTIVES)
DEFAULT = NAMES[0]  # what a run minimises unless told: the next-token loss


def names_for(config: str) -> tuple[str, ...]:
    """The objectives whose fields the arguments class ``module:Class`` holds, in registry order."""
    return tuple(name for name, entry in OBJECTIVES.items() if entry.config == config)


def exports() -> dict[str, str]:
    """The public names of the objectives' arguments and Trainers, each with its module."""
    found = {}
    for entry in OBJECTIVES.values():
        for path in (entry.config, entry.trainer):
            module, _, name = path.partition(":")
            found[name] = module
    return found
