"""The offline SFT-then-DPO recipe (``make sft-dpo``), scaled down: the default job's model for 2 steps,
``scripts/recipes/stdlib_tasks.py`` for the rows and pairs, then ``scripts/train.py --config
scripts/recipes/sft_stdlib.yaml`` and ``--config scripts/recipes/dpo_stdlib.yaml`` with the model and
data paths of the test and a few steps, each one process (``make sft-dpo`` runs these lines)."""

from __future__ import annotations

import ast
import json
import math

import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics

SHORT = ["--max_steps", "4", "--logging_steps", "1", "--eval_steps", "4", "--save_steps", "4"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_dpo")
    launch(
        ["scripts/recipes/stdlib_tasks.py", str(root / "tasks"), "--sft", "96", "--pairs", "48"],
        launcher="python",
    )
    launch(["scripts/train.py", "--output_dir", str(root / "default"), "--max_steps", "2", "--eval_strategy", "no",
            "--save_strategy", "no"], launcher="python")  # fmt: skip
    stages = (("sft", "scripts/recipes/sft_stdlib.yaml", "default", "sft.jsonl"),
              ("dpo", "scripts/recipes/dpo_stdlib.yaml", "sft", "prefs.jsonl"))  # fmt: skip
    for stage, config, model, data in stages:
        launch(["scripts/train.py", "--config", config, "--output_dir", str(root / stage), "--model_name_or_path",
                str(root / model / "final"), "--dataset", str(root / "tasks" / data), *SHORT], launcher="python")  # fmt: skip
    return root


def test_the_tasks_are_functions_split_at_their_docstrings(recipe):
    rows = [json.loads(line) for line in (recipe / "tasks" / "sft.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (recipe / "tasks" / "prefs.jsonl").read_text().splitlines()]
    assert (len(rows), len(pairs)) == (96, 48)
    for row in rows[:20]:  # prompt and body make one documented function; the prompt ends with its docstring
        (function,) = ast.parse(row["prompt"] + row["completion"]).body
        assert ast.get_docstring(function) is not None
        assert function.body[0].end_lineno == row["prompt"].count("\n") and len(function.body) > 1
    for pair in pairs:  # the rejected answer is the chosen one's lines, in another order
        assert pair["rejected"] != pair["chosen"]
        assert sorted(pair["rejected"].splitlines()) == sorted(pair["chosen"].splitlines())
    assert not {r["prompt"] for r in rows} & {p["prompt"] for p in pairs}  # no function in both sets


def test_sft_trains_the_default_model_and_dpo_starts_from_it_at_ln2(recipe):
    sft = [r for r in read_metrics(recipe / "sft") if "loss" in r and "train_runtime" not in r]
    assert len(sft) == 4 and all(math.isfinite(r["loss"]) for r in sft)
    assert (recipe / "sft" / "final" / "config.json").is_file()
    dpo = [r for r in read_metrics(recipe / "dpo") if "loss" in r and "train_runtime" not in r]
    assert len(dpo) == 4
    assert abs(dpo[0]["loss"] - math.log(2)) < 1e-5  # the policy is its reference, the SFT model
    assert {"rewards/chosen", "rewards/accuracies", "logps/chosen"} <= set(dpo[0])
    assert any("eval_loss" in r for r in read_metrics(recipe / "dpo"))
    assert (recipe / "dpo" / "final" / "config.json").is_file()
