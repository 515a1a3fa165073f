"""HF's logging and data-loading fields through ``scripts/train.py``, as a user passes them."""

from __future__ import annotations

from tests.helpers.launch import launch
from tests.helpers.scaffold import read_metrics, tiny_flags

TINY = tiny_flags(max_steps=6, logging_steps=None, save_steps=None, eval_steps=None, per_device_train_batch_size=8,
                  max_train_samples=24, max_eval_samples=8, save_strategy="no", eval_strategy="no")  # fmt: skip
HF_FLAGS = ["--do_train", "--do_eval", "--eval_on_start", "true", "--logging_strategy", "epoch",
            "--data_seed", "7", "--ddp_timeout", "600", "--dataloader_num_workers", "1",
            "--dataloader_persistent_workers", "true", "--dataloader_prefetch_factor", "2"]  # fmt: skip


def test_eval_on_start_epoch_logging_and_loader_options(tmp_path):
    out = tmp_path / "run"
    launch(["scripts/train.py", "--output_dir", str(out), *TINY, *HF_FLAGS], launcher="python")
    rows = read_metrics(out)
    assert "eval_loss" in rows[0] and rows[0]["step"] == 0  # evaluated before the first step
    # 24 samples in batches of 8: epochs end at steps 3 and 6, and only epoch ends log.
    assert [r["step"] for r in rows if "loss" in r] == [3, 6]
    assert all(r["loss"] > 0 for r in rows if "loss" in r)
