"""A full disk during training, through ``scripts/train.py``: a save that would not fit is skipped
(save_failure_policy=continue) or a save that runs out of space stops the run (stop, exit 74), each
with one line naming the bytes; complete checkpoints stay complete and no partial files are left.
With ``continue`` nothing is lost: the last complete checkpoint keeps its bytes and verifies, and the
run trains to its end with the losses and final weights of a run whose saves all succeed.

Two ways to fill the disk. A small tmpfs for output_dir is the real thing (statvfs reports it full,
writes fail with ENOSPC), where this process may mount one. Everywhere, a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) makes the write of a checkpoint's optimizer file fail with EFBIG
while the final export, a third of a checkpoint's size, still fits: the same save path (the rank's
"no" vote, the staging directory removed, ``save_failure_policy``), with the writer's reason in the
line in place of the bytes, since the filesystem itself still has room."""

from __future__ import annotations

import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.launch import ROOT, run_env
from tests.helpers.scaffold import (
    TINY_MODEL,
    assert_same_weights,
    file_digests,
    mounted_tmpfs,
    tiny_flags,
    train_rows,
)
from trainer import checkpoint as ckpt
from trainer.model.modeling import DEFAULT_LLAMA

# Every checkpoint is kept (save_total_limit 3): the undisturbed run's checkpoint-2 is a resume point.
# AdamW, whose checkpoint size (two moments a parameter) the disk sizes below count on.
TINY = tiny_flags(max_steps=None, save_steps=2, eval_steps=1000, max_train_samples=100, max_eval_samples=8,
                  vocab_size=4096, save_total_limit=3, optim="adamw_torch")  # fmt: skip
KIB = 1024


def n_params() -> int:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**DEFAULT_LLAMA, "vocab_size": 4096, **TINY_MODEL}))
    return sum(p.numel() for p in model.parameters())


def estimate() -> int:
    """What the first save expects (the planner's fp32 figure: weights 4 + Adam 8 bytes per parameter)."""
    return 12 * n_params()


def train(out, *extra, file_limit: int | None = None):
    """``scripts/train.py`` on one process; ``file_limit``: no file it writes may grow past that."""

    def limit_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    proc = subprocess.run(
        [sys.executable, "scripts/train.py", "--output_dir", str(out), *TINY, *extra],
        cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=900,
        preexec_fn=limit_files if file_limit else None,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Path:
    """Six steps whose saves (2, 4, 6) all succeed."""
    out = tmp_path_factory.mktemp("disk") / "undisturbed"
    code, text = train(out, "--max_steps", "6")
    assert code == 0, text
    return out


def assert_nothing_lost(out: Path, undisturbed: Path, resumed_at: int = 0) -> None:
    """Only checkpoint-2 is complete, it verifies, no partial files are left, and the run (resumed at
    step ``resumed_at``) trained to its end as the undisturbed one did: the same loss at every step,
    bitwise the same exported weights."""
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2"]
    assert ckpt.verify(out / "checkpoint-2") == []
    assert not list(out.glob(".staging-*"))
    want = {row["step"]: row["loss"] for row in train_rows(undisturbed) if row["step"] > resumed_at}
    assert {row["step"]: row["loss"] for row in train_rows(out)} == want and max(want) == 6
    assert_same_weights(out / "final", undisturbed / "final")


def test_a_save_that_would_not_fit_is_skipped_and_training_goes_on(tmp_path, undisturbed):
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
        assert_nothing_lost(out, undisturbed)
        assert "Traceback" not in text


def test_a_disk_that_fills_during_a_save_stops_the_run_and_its_rerun_until_there_is_room(tmp_path):
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

        # A rerun into the same full disk stops at its door, before anything loads: its one line is
        # all it prints, and nothing is trained or written.
        metrics = (out / "metrics.jsonl").read_bytes()
        code, text = train(out, "--max_steps", "4")
        assert code == 74, text
        assert re.fullmatch(
            r"error: the disk is still full: checkpoint-2 was not saved for lack of space, it needs more "
            r"than the [\d.]+ MiB it did not fit in, and the filesystem of output_dir has [\d.]+ MiB free "
            r"\(output_dir/full_disk\.json\)\. Free space, then rerun: it resumes from the newest "
            r"complete checkpoint\.",
            text.strip(),
        ), text
        assert (out / "metrics.jsonl").read_bytes() == metrics

        # With the space there, the rerun trains to its end and the note is gone.
        subprocess.run(["mount", "-o", f"remount,size={3 * estimate() + 4096 * KIB}", str(disk)], check=True)
        code, text = train(out, "--max_steps", "4")
        assert code == 0, text
        assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
        assert (out / "final" / "model.safetensors").is_file()
        assert not (out / "full_disk.json").exists()


# A checkpoint's optimizer file holds 12 bytes a parameter (fp32 weights and Adam's two moments), the
# export 4: a limit of 6 lets the export through and no checkpoint.
FILE_LIMIT = 6 * n_params()
# torch.save reports the short write in its own words (no errno), so the line's reason is not pinned.
TOO_LARGE = r"checkpoint-{step} not saved: rank 0: .+; its partial files were removed\."


def test_saves_that_fail_while_writing_are_skipped_and_nothing_is_lost(tmp_path, undisturbed):
    # The undisturbed run's checkpoint-2, in a directory of its own: the rerun resumes it on the
    # same schedule (six steps), and every later save fails.
    out = tmp_path / "run"
    shutil.copytree(undisturbed / "checkpoint-2", out / "checkpoint-2")
    kept = file_digests(out / "checkpoint-2")
    code, text = train(out, "--max_steps", "6", "--save_failure_policy", "continue", file_limit=FILE_LIMIT)
    assert code == 0, text
    warnings = [line for line in text.splitlines() if " not saved: " in line]
    assert len(warnings) == 2, text
    for step, line in zip((4, 6), warnings, strict=True):
        warning = (
            "warning: "
            + TOO_LARGE.format(step=step)
            + r" Training goes on; the next save is tried as planned\."
        )
        assert re.fullmatch(warning, line), line
    assert f"Resumed from {out / 'checkpoint-2'} at step 2." in text
    assert file_digests(out / "checkpoint-2") == kept
    assert_nothing_lost(out, undisturbed, resumed_at=2)
    assert "Traceback" not in text


def test_a_save_that_fails_while_writing_stops_the_run_with_one_line(tmp_path):
    out = tmp_path / "run"
    code, text = train(out, "--max_steps", "4", file_limit=FILE_LIMIT)
    assert code == 74, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    error = (
        "error: "
        + TOO_LARGE.format(step=2)
        + r" Rerun once that is fixed: it resumes from the newest complete checkpoint\."
    )
    assert re.fullmatch(error, errors[0]), errors[0]
    assert ckpt.complete_checkpoints(out) == []
    assert not list(out.glob(".staging-*"))
    assert "Traceback" not in text
