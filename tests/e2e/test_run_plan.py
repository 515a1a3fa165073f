"""One plan per run: a CLI run (``scripts/train.py``) and a hand-built ``Trainer`` each resolve
their DeepSpeed config once and start their process group once, and under ZeRO-3 ``zero.Init``
partitions the model with the very config the engine is built from. Counted in real runs
(tests/helpers/count_run.py wraps the functions), on one process."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed

TINY = [
    "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "2",
    "--max_train_samples", "64", "--max_eval_samples", "8", "--block_size", "64", "--vocab_size", "4096",
    "--model_config_overrides", '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}',
]  # fmt: skip


def counted(tmp_path, mode: str, *flags: str) -> tuple[dict, dict]:
    launch(["tests/helpers/count_run.py", mode, str(tmp_path), *flags], launcher="python")
    found = json.loads((tmp_path / "counts.json").read_text())
    return found["counts"], found["configs"]


def test_a_cli_run_resolves_once_and_partitions_with_the_engines_config(tmp_path):
    counts, configs = counted(
        tmp_path, "cli", "--output_dir", str(tmp_path / "run"), "--zero_stage", "3", *TINY
    )
    # `check` is the dry run before anything loads (bad input fails fast); its dict is not kept.
    assert counts["resolve"] - counts.get("resolve from check", 0) == 1, counts
    assert counts["resolve from plan_run"] == 1, counts
    assert counts["init_distributed"] == 1, counts
    assert counts["init_process_group"] == 1, counts
    assert counts["deepspeed.initialize"] == 1, counts
    assert counts["zero.Init"] >= 1, counts
    engine = configs["engine"][0]
    assert all(zero_init == engine for zero_init in configs["zero_init"])
    assert engine == json.loads((tmp_path / "run" / "ds_config.json").read_text())
    assert engine["zero_optimization"]["stage"] == 3


def test_an_api_run_resolves_once_and_starts_one_process_group(tmp_path):
    counts, configs = counted(tmp_path, "api")
    assert counts["resolve"] == 1 and counts["resolve from plan_run"] == 1, counts
    assert counts["init_distributed"] == 1, counts
    assert counts["init_process_group"] == 1, counts
    assert counts["deepspeed.initialize"] == 1, counts
    assert configs["engine"][0] == json.loads((tmp_path / "run" / "ds_config.json").read_text())
