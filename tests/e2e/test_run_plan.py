"""One plan per run: a CLI run (``scripts/train.py``) and a hand-built ``Trainer`` each resolve
their DeepSpeed config once (a hand-built ZeRO-3 run also partly at its arguments' creation, for
``zero.Init``), start their process group once, check the sequence split and take output_dir's lock once,
and under ZeRO-3 ``zero.Init`` partitions the model with the very config the engine is built from.
Counted in real runs (tests/helpers/count_run.py wraps the functions), on one process."""

from __future__ import annotations

import json

from tests.helpers.launch import launch

TINY = [
    "--max_steps", "2", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "2",
    "--max_train_samples", "64", "--max_eval_samples", "8", "--block_size", "64", "--vocab_size", "4096",
    "--model_config_overrides", '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}',
    # AdamW: DeepSpeed builds it from the config the engine is handed (the recipe's Muon is built by
    # the engine, which hands DeepSpeed the config without its optimizer section)
    "--optim", "adamw_torch",
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
    # The CLI's door claims output_dir; the Trainer's claim of it later takes no lock again.
    assert counts["lock"] == 1 and counts["claim_output_dir from run"] == 1, counts
    # The CLI's early check is the run's one (before anything loads); build_run does not repeat it.
    # At one process the split is 1, which the CLI has nothing to check for.
    assert counts.get("check_layout", 0) == counts.get("check_layout from _check_inputs", 0) == 0, counts
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
    assert counts["lock"] == 1 and counts["claim_output_dir from train"] == 1, counts
    assert "zero.Init" not in counts and "check_layout" not in counts, counts
    assert configs["engine"][0] == json.loads((tmp_path / "run" / "ds_config.json").read_text())


def test_a_zero3_api_run_partitions_with_the_dict_its_engine_runs(tmp_path):
    """HF's way: ``TrainingArguments(zero_stage=3)`` registers a config with transformers when created,
    the script's model is built (partitioned by ``zero.Init``) after them, and the Trainer's plan fills
    the run's final resolution into that same dict for the engine."""
    counts, configs = counted(tmp_path, "api-zero3")
    # Two resolutions, one of them partial: at the arguments' creation (zero3_init: the hidden size
    # and the run's length are unknown there), then the run's own in plan_run, filled into that dict.
    assert counts["resolve"] == 2, counts
    assert counts["resolve from zero3_init"] == 1 and counts["resolve from plan_run"] == 1, counts
    assert counts["init_distributed"] == 1, counts
    assert counts["init_process_group"] == 1, counts  # zero.Init's, at the model: the Trainer joins it
    assert counts["deepspeed.initialize"] == 1, counts
    assert counts["lock"] == 1, counts
    assert counts["zero.Init"] >= 1, counts
    engine_id = configs["engine_ids"][0]
    assert configs["zero_init_ids"] and all(i == engine_id for i in configs["zero_init_ids"]), configs
    engine = configs["engine"][0]
    assert engine == json.loads((tmp_path / "run" / "ds_config.json").read_text())
    filled = {"stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "reduce_bucket_size"}
    for zero_init in configs["zero_init"]:  # what partitioned the model is what the engine runs
        used, final = zero_init["zero_optimization"], engine["zero_optimization"]
        assert used == {k: v for k, v in final.items() if k not in filled or k in used}, (used, final)
        assert all(
            zero_init.get(d, {}).get("enabled") == engine.get(d, {}).get("enabled") for d in ("bf16", "fp16")
        )
    assert engine["zero_optimization"]["stage"] == 3
    assert engine["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * 32  # filled: hidden 32
