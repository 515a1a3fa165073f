"""scripts/train.py given a corrupt checkpoint: one line naming the file, exit status 2, no training."""

from __future__ import annotations

from tests.helpers.launch import launch
from tests.helpers.scaffold import tiny_flags
from tests.unit.test_checkpoint import flip_byte, make_checkpoint

SMALL = tiny_flags(max_steps=2, logging_steps=None, save_steps=None, eval_steps=None, max_train_samples=16,
                   max_eval_samples=4, block_size=32, model_config_overrides=None)  # fmt: skip


def test_corrupt_explicit_checkpoint_exits_with_one_error_line(tmp_path):
    out = tmp_path / "run"
    # Checksums are compared before DeepSpeed reads anything, so a small stand-in checkpoint will do.
    path = make_checkpoint(out, 2, world=1)
    flip_byte(path / "ds" / "mp_rank_00_model_states.pt")
    proc = launch(
        ["scripts/train.py", "--output_dir", str(out), *SMALL, "--resume_from_checkpoint", str(path)],
        launcher="python",
        check=False,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    error = f"error: resume_from_checkpoint: {path}/ds/mp_rank_00_model_states.pt: checksum does not match the manifest"
    assert error in text.splitlines()
    assert "Traceback" not in text
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()
