"""The offline SFT-then-DPO recipe (``make sft-dpo``) and the online RL one (``make grpo``), scaled
down: the default job's model for 2 steps, ``scripts/recipes/stdlib_tasks.py`` for the rows, pairs
and prompts, then ``scripts/train.py --config scripts/recipes/sft_stdlib.yaml``, ``--config
scripts/recipes/dpo_stdlib.yaml`` and ``--config scripts/recipes/grpo_stdlib.yaml`` with the model
and data paths of the test and a few steps, each one process, and ``scripts/recipes/parse_share.py``
on the GRPO run's model (``make sft-dpo`` and ``make grpo`` run these lines)."""

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
        [
            "scripts/recipes/stdlib_tasks.py",
            str(root / "tasks"),
            "--sft",
            "96",
            "--pairs",
            "48",
            "--prompts",
            "16",
            "--held_prompts",
            "4",
        ],
        launcher="python",
    )
    launch(["scripts/train.py", "--output_dir", str(root / "default"), "--max_steps", "2", "--eval_strategy", "no",
            "--save_strategy", "no"], launcher="python")  # fmt: skip
    stages = (("sft", "scripts/recipes/sft_stdlib.yaml", "default", "sft.jsonl"),
              ("dpo", "scripts/recipes/dpo_stdlib.yaml", "sft", "prefs.jsonl"))  # fmt: skip
    for stage, config, model, data in stages:
        launch(["scripts/train.py", "--config", config, "--output_dir", str(root / stage), "--model_name_or_path",
                str(root / model / "final"), "--dataset", str(root / "tasks" / data), *SHORT], launcher="python")  # fmt: skip
    launch(["scripts/train.py", "--config", "scripts/recipes/grpo_stdlib.yaml", "--output_dir", str(root / "grpo"),
            "--model_name_or_path", str(root / "default" / "final"), "--dataset", str(root / "tasks" / "prompts.jsonl"),
            "--max_steps", "2", "--logging_steps", "1", "--max_completion_length", "16"], launcher="python")  # fmt: skip
    measured = launch(["scripts/recipes/parse_share.py", str(root / "grpo" / "final"),
                       str(root / "tasks" / "held_prompts.jsonl"), "--samples", "2", "--max_new_tokens", "16",
                       "--temperature", "0.7", "--batch", "8"], launcher="python")  # fmt: skip
    (root / "parse_share.json").write_text(measured.stdout.strip().splitlines()[-1])
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


def test_grpo_recipe_trains_on_the_prompts(recipe):
    """The prompts are def lines and docstrings that parse alone; GRPO generates 8 completions of
    each of 2 prompts a step, scores them with ``python_body`` and logs the share that parse; the
    measure runs on the held-out prompts (an untrained model writes no body that parses)."""
    prompts = [
        json.loads(line)["prompt"] for line in (recipe / "tasks" / "prompts.jsonl").read_text().splitlines()
    ]
    held = [
        json.loads(line)["prompt"]
        for line in (recipe / "tasks" / "held_prompts.jsonl").read_text().splitlines()
    ]
    assert (len(prompts), len(held)) == (16, 4) and not set(prompts) & set(held)
    for prompt in prompts:
        (function,) = ast.parse(prompt).body
        assert ast.get_docstring(function) is not None and len(function.body) == 1
    rows = [r for r in read_metrics(recipe / "grpo") if "loss" in r and "train_runtime" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert {"reward", "rewards/python_body/mean", "python/parses", "completions/mean_length"} <= set(row)
        assert 0 <= row["python/parses"] <= 1 and row["completions/mean_length"] <= 16
    measured = json.loads((recipe / "parse_share.json").read_text())
    assert measured["completions"] == 8 and 0 <= measured["parse_share"] <= 1
