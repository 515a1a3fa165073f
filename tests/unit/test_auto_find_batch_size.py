"""HF's ``auto_find_batch_size`` through the user's door: a small Llama that runs out of memory above
3 rows per forward, trained with ``Trainer(...).train()`` at ``per_device_train_batch_size=8``, finishes
at the largest micro-batch that fits (8 -> 4 -> 2) with the losses and grad norms of a run started at
2; without the field the model's error reaches the user; ZeRO-3 is refused naming both settings, on the
API and on the command line. One child process (plain python, one rank) runs the API cases
(tests/helpers/auto_batch_scenario.py); the distributed case is tests/distributed/test_auto_find_batch_size.py.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch
from tests.helpers.scaffold import tiny_flags

REFUSAL = (
    "auto_find_batch_size: cannot be used with zero_optimization.stage 3: the model is partitioned when it "
    "is built, and is not built again; set per_device_train_batch_size to a size that fits (`trainer plan` "
    "finds one)"
)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_batch")
    proc = launch(
        ["tests/helpers/auto_batch_scenario.py", str(out), "one_rank"], launcher="python", timeout=600
    )
    runs = {p.name: json.loads((p / "rank0.json").read_text()) for p in out.iterdir() if p.is_dir()}
    return runs, proc.stdout


def test_an_out_of_memory_first_step_trains_again_at_half_the_micro_batch(one_rank):
    runs, stdout = one_rank
    auto, direct = runs["auto"], runs["direct"]
    # The largest micro-batch that fits, in the arguments the Trainer runs and in DeepSpeed's config;
    # the accumulation steps are kept, as HF's; the user's arguments are not changed.
    assert (auto["micro_batch"], auto["ds_micro_batch"], auto["ds_accumulation"]) == (2, 2, 2)
    assert auto["user_micro_batch"] == 8
    # One line per retry, with the old and the new micro-batch.
    lines = [
        line for line in stdout.splitlines() if line.startswith("auto_find_batch_size:") and "forward" in line
    ]
    assert len(lines) == 2, stdout
    for line, (old, new) in zip(lines, ((8, 4), (4, 2)), strict=True):
        assert f"out of memory at per_device_train_batch_size {old} " in line
        assert f"from step 0 at per_device_train_batch_size {new} " in line
        assert f"({old} rows; this model fits 3)" in line  # the user's error, named
    # Step for step the run started at 2: the same seed, weights and data order, from step 0.
    assert auto["steps"] == direct["steps"] == [1, 2, 3]
    assert auto["losses"] == direct["losses"]
    assert auto["grad_norms"] == direct["grad_norms"]


def test_an_optimizer_step_out_of_memory_after_its_update_restores_the_weights(one_rank):
    """The failed step had updated the weights before it ran out of memory: the retry at 4, then at
    2, starts from the weights train() began with, so it trains as the run started at 2."""
    runs, stdout = one_rank
    auto, direct = runs["auto_step"], runs["direct"]
    assert auto["micro_batch"] == 2 and auto["steps"] == [1, 2, 3]
    assert "out of memory at per_device_train_batch_size 8 (CUDA out of memory" in stdout
    assert auto["losses"] == direct["losses"]
    assert auto["grad_norms"] == direct["grad_norms"]


def test_without_auto_find_batch_size_the_users_out_of_memory_error_is_raised(one_rank):
    runs, stdout = one_rank
    assert runs["no_auto"]["error"] == [
        "OutOfMemoryError",
        "CUDA out of memory. Tried to allocate 2.00 GiB (8 rows; this model fits 3)",
    ]


def test_zero3_is_refused_naming_both_settings(one_rank):
    runs, _ = one_rank
    assert runs["zero3"]["error"] == ["ConfigError", REFUSAL]


def test_the_command_line_refuses_zero3_with_one_line(tmp_path):
    out = tmp_path / "out"
    argv = [
        "scripts/train.py",
        *tiny_flags(output_dir=str(out), max_steps=1, save_steps=None, eval_steps=None),
    ]
    argv += ["--auto_find_batch_size", "true", "--zero_stage", "3"]
    proc = launch(argv, launcher="python", timeout=600, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {REFUSAL}"
    assert "Traceback" not in proc.stderr
