"""HF's learning-rate schedules DeepSpeed has no equivalent of, through ``scripts/train.py``: the
rate at every step is transformers' own schedule, and a resume continues it exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import get_scheduler

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics, tiny_flags
from trainer.cli import train as train_cli

STEPS, LR, WARMUP = 6, 1e-3, 2
SCHEDULE = ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}']
# AdamW: one rate for every parameter (the recipe's Muon logs its own half's rate)
TINY = [*tiny_flags(max_steps=STEPS, save_steps=3, eval_steps=None, eval_strategy="no", max_train_samples=100,
                    max_eval_samples=None, learning_rate=LR, warmup_steps=WARMUP, optim="adamw_torch"),
        *SCHEDULE]  # fmt: skip


def train(out: Path) -> None:
    launch(["scripts/train.py", "--output_dir", str(out), *TINY], launcher="python")


def rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """One run straight through, and one resumed from the first's checkpoint-3."""
    root = tmp_path_factory.mktemp("schedules")
    train(root / "straight")
    (root / "resumed").mkdir()
    shutil.copytree(root / "straight" / "checkpoint-3", root / "resumed" / "checkpoint-3")
    train(root / "resumed")
    return root / "straight", root / "resumed"


def test_the_rate_at_every_step_is_transformers_schedule(runs):
    straight, _ = runs
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=LR)
    schedule = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=WARMUP,
                             num_training_steps=STEPS, scheduler_specific_kwargs={"min_lr_rate": 0.1})  # fmt: skip
    expected = []
    for _ in range(STEPS):  # each step logs the rate it applied, as HF's Trainer logs it
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    got = [rows(straight)[step]["learning_rate"] for step in range(1, STEPS + 1)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert min(got[WARMUP:]) >= 0.1 * LR * (
        1 - 1e-9
    )  # the kwargs reached the schedule: it stops at min_lr_rate
    # The schedule is transformers' (a client scheduler), so the DeepSpeed config defines none.
    assert "scheduler" not in json.loads((straight / "ds_config.json").read_text())


def test_a_resume_continues_the_schedule_and_the_losses_exactly(runs):
    straight, resumed = runs
    a, b = rows(straight), rows(resumed)
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert (b[step]["loss"], b[step]["learning_rate"]) == (a[step]["loss"], a[step]["learning_rate"])


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--optim", "adafactor", "DeepSpeed has no Adafactor; use adamw_torch"),
        ("--lr_scheduler_type", "reduce_lr_on_plateau", "steps on evaluation metrics"),
    ],
)
def test_hf_names_without_a_deepspeed_counterpart_are_refused_with_the_alternative(capsys, flag, value, says):
    assert train_cli.main([flag, value]) == train_cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{flag[2:]}: " in err and says in err
