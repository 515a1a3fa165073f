"""A full disk during training, through ``scripts/train.py`` with output_dir on a small tmpfs: a save
that would not fit is skipped (save_failure_policy=continue) or a save that runs out of space stops
the run (stop, exit 74), each with one line naming the bytes; complete checkpoints stay complete and
no partial files are left."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.launch import launch
from tests.helpers.scaffold import TINY_MODEL, mounted_tmpfs, tiny_flags
from trainer import checkpoint as ckpt
from trainer.model.modeling import DEFAULT_LLAMA

pytestmark = pytest.mark.distributed

TINY = tiny_flags(max_steps=None, save_steps=2, eval_steps=1000, max_train_samples=100, max_eval_samples=8,
                  vocab_size=4096)  # fmt: skip
KIB = 1024


def estimate() -> int:
    """What the first save expects (the planner's fp32 figure: weights 4 + Adam 8 bytes per parameter)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**DEFAULT_LLAMA, "vocab_size": 4096, **TINY_MODEL}))
    return 12 * sum(p.numel() for p in model.parameters())


def train(out, *extra):
    proc = launch(
        ["scripts/train.py", "--output_dir", str(out), *TINY, *extra], launcher="python", check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_a_save_that_would_not_fit_is_skipped_and_training_goes_on(tmp_path):
    # Room for checkpoint-2 (the estimate plus ~290 KiB of tokenizer and RNG files), then 2.2 MiB:
    # enough for final/, not for checkpoint-4.
    with mounted_tmpfs(tmp_path / "disk", estimate() + 300 * KIB + 2200 * KIB) as disk:
        out = disk / "run"
        code, text = train(out, "--max_steps", "6", "--save_failure_policy", "continue")
        assert code == 0, text
        warnings = [line for line in text.splitlines() if " not saved: " in line]
        assert len(warnings) == 2, text
        for step, line in zip((4, 6), warnings, strict=True):
            assert re.fullmatch(
                rf"warning: checkpoint-{step} not saved: the disk is full: a checkpoint needs about "
                r"[\d.]+ MiB \(the size of checkpoint-2\), and the filesystem of output_dir has [\d.]+ MiB "
                r"free: [\d.]+ MiB short\. Training goes on; the next save is tried as planned\.",
                line,
            ), line
        assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2"]
        assert ckpt.verify(out / "checkpoint-2") == []
        assert not list(out.glob(".staging-*"))
        assert (out / "final" / "model.safetensors").is_file()
        assert "Traceback" not in text


def test_a_disk_that_fills_during_a_save_stops_the_run_with_one_line(tmp_path):
    # The first save's estimate fits, the checkpoint itself (its tokenizer files too) does not.
    with mounted_tmpfs(tmp_path / "disk", estimate() + 150 * KIB) as disk:
        out = disk / "run"
        code, text = train(out, "--max_steps", "4")
        assert code == 74, text
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, text
        assert re.fullmatch(
            r"error: checkpoint-2 not saved: the disk is full: the checkpoint did not fit in the [\d.]+ MiB "
            r"free on the filesystem of output_dir \(about [\d.]+ MiB expected, estimated: weights and "
            r"optimizer states\); its partial files were removed\. Rerun once that is fixed: it resumes "
            r"from the newest complete checkpoint\.",
            errors[0],
        ), errors[0]
        assert ckpt.complete_checkpoints(out) == []
        assert not list(out.glob(".staging-*"))
        assert "Traceback" not in text
