"""The launch matrix: ``scripts/train.py`` under every launcher and ZeRO setting, a few optimizer steps
of a tiny model on the embedded default recipe, each case launched once per test session.

``tests/e2e/test_launch_matrix.py`` checks every case; other modules read the same runs rather than
launching their own (the multi-node run compares itself with one, ``test_train_script.py`` reads the
default command's outputs and resumes a copy of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helpers.launch import ROOT, launch
from tests.helpers.scaffold import tiny_flags

STEPS = 4
TINY = tiny_flags(max_steps=STEPS, save_steps=STEPS, eval_steps=STEPS, vocab_size=4096)

RECIPE = yaml.safe_load((ROOT / "scripts" / "recipes" / "default.yaml").read_text())


@dataclass(frozen=True)
class Case:
    launcher: str  # deepspeed, torchrun, accelerate or python
    args: tuple[str, ...]  # what the user adds to scripts/train.py
    stage: int = RECIPE["zero_stage"]  # the ZeRO stage ds_config.json must show
    ranks: int = 2
    offload: tuple[str, str] = ("none", "none")  # (optimizer, param) devices in ds_config.json
    precision: str = "fp32"
    model: str = "llama"
    checkpointing: bool = False  # the arguments turn activation checkpointing on
    pipeline: int = 1  # pipeline stages
    # The recipe's micro-batch, unless the arguments name a recipe or DeepSpeed config stating another.
    micro_batch: int = RECIPE["per_device_train_batch_size"]
    # ds_config.json's optimizer: the recipe's Muon, or AdamW where it gives way (pipeline stages),
    # the arguments name it or another recipe
    optimizer: str = "Muon"


# Cases whose arguments are a README/docs line's (tests/e2e/test_doc_commands.py checks that every
# launch line in the docs is one of these) run exactly those arguments, with TINY appended.
CASES = {
    "deepspeed-default": Case("deepspeed", ()),
    "deepspeed-zero0": Case("deepspeed", ("--zero_stage", "0"), 0),
    # AdamW instead of the recipe's Muon: the trajectory of the runs where Muon gives way
    "deepspeed-zero0-adamw": Case(
        "deepspeed", ("--zero_stage", "0", "--optim", "adamw_torch"), 0, optimizer="Adam"
    ),
    "deepspeed-zero1-bf16": Case("deepspeed", ("--zero_stage", "1", "--bf16"), 1, precision="bf16"),
    "deepspeed-zero2-offload": Case(
        "deepspeed",
        ("--zero_stage", "2", "--offload_optimizer", "cpu"),
        2,
        offload=("cpu", "none"),
    ),
    "deepspeed-zero3": Case("deepspeed", ("--zero_stage", "3"), 3),
    "deepspeed-zero3-offload": Case(
        "deepspeed",
        ("--zero_stage", "3", "--offload_param", "cpu", "--offload_optimizer", "cpu"),
        3,
        offload=("cpu", "cpu"),
    ),
    "deepspeed-json-zero3-checkpointing": Case(
        "deepspeed",
        ("--deepspeed", "ds_configs/zero3_fp32.json", "--gradient_checkpointing", "true"),
        3,
        micro_batch=8,
        checkpointing=True,
    ),
    "deepspeed-pipeline2-checkpointing": Case(
        "deepspeed",
        ("--pipeline_parallel_size", "2", "--zero_stage", "1", "--gradient_checkpointing", "true"),
        1,
        checkpointing=True,
        pipeline=2,
        optimizer="Adam",
    ),
    "torchrun-zero3-offload-bf16": Case(
        "torchrun",
        ("--zero_stage", "3", "--offload_optimizer", "cpu", "--bf16"),
        3,
        offload=("cpu", "none"),
        precision="bf16",
    ),
    # GPT-2 from the pretraining recipe: ZeRO-2, activation checkpointing, 4 accumulation steps.
    "torchrun-zero2-checkpointing-gpt2": Case(
        "torchrun",
        ("--config", "scripts/recipes/gpt2_pretrain.yaml"),
        2,
        model="gpt2",
        micro_batch=8,
        checkpointing=True,
        optimizer="Adam",
    ),
    "accelerate-zero2": Case("accelerate", ("--zero_stage", "2"), 2),
    "python-zero0": Case("python", ("--zero_stage", "0"), 0, ranks=1),
    "python-zero3": Case("python", ("--zero_stage", "3"), 3, ranks=1),
}
REFERENCE = "deepspeed-zero0"
# Where the recipe's Muon gives way to AdamW (pipeline stages), the runs follow this one.
ADAM_REFERENCE = "deepspeed-zero0-adamw"
ONE_RANK_REFERENCE = "python-zero0"


@dataclass
class Run:
    out: Path
    stdout: str
    stderr: str


class MatrixRuns:
    """Launches each case the first time a test asks for it; later tests reuse the run."""

    def __init__(self, root: Path):
        self.root = root
        self.done: dict[str, Run] = {}

    def __call__(self, name: str) -> Run:
        if name not in self.done:
            case, out = CASES[name], self.root / name
            proc = launch(
                ["scripts/train.py", "--output_dir", str(out), *case.args, *TINY],
                nproc=case.ranks,
                launcher=case.launcher,
            )
            self.done[name] = Run(out, proc.stdout, proc.stderr)
        return self.done[name]
