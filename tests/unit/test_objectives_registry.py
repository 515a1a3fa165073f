"""The objectives' registry (``trainer/objectives/``): every entry's parts load and agree, each
door reads the registry, and an objective's name is written nowhere else in the package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trainer
from trainer.args import RunConfig
from trainer.objectives import DEFAULT, NAMES, OBJECTIVES, exports

ROOT = Path(__file__).resolve().parents[2]
# TRL's loss types named like an objective: CPO's "simpo" (the objective simpo is CPO running it),
# KTO's "kto" (beside apo_zero_unpaired) and GRPO's "grpo" (beside dapo, bnpo, dr_grpo), in the
# configs that declare them and the losses.
LOSS_TYPE_NAMES = {
    (f"trainer/{where}/preference.py", name) for where in ("args", "engine") for name in ("simpo", "kto")
} | {(f"trainer/{where}/rl.py", "grpo") for where in ("args", "engine")}


def test_an_objectives_name_is_written_only_in_the_registry():
    written = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("trainer/objectives/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in NAMES
                and (rel, node.value) not in LOSS_TYPE_NAMES
            ):
                written.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert written == []


@pytest.mark.parametrize("name", NAMES)
def test_each_entry_loads_and_its_parts_agree(name):
    entry = OBJECTIVES[name]
    config = entry.config_class()
    assert name in config.OBJECTIVES
    rewards = {"reward_funcs": "module:function"} if entry.data == "prompts" else {}  # online RL needs some
    args = RunConfig.from_flat({"objective": name, **rewards}).training
    assert type(args) is config and args.objective == name
    trainer_class = entry.trainer_class()
    assert getattr(trainer, trainer_class.__name__) is trainer_class
    assert getattr(trainer, config.__name__) is config
    loss = entry.loss_class()
    if loss is None:  # the model's own loss, chosen per model
        assert name == DEFAULT
    else:
        objective = loss.from_args(args)
        assert objective.metric_names  # what a row forwards is the registry's alone (sequences_per_row)
        assert not hasattr(objective, "sequences_per_row")


def test_the_exports_are_the_registrys_and_the_cli_offers_every_name():
    assert set(exports()) <= set(trainer.__all__)
    out = subprocess.run(
        [sys.executable, "-m", "trainer.cli.main", "plan", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "{" + ",".join(NAMES) + "}" in out.replace("\n", "").replace(" ", "")
