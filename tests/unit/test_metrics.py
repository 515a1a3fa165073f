"""The metrics.jsonl writer, its reader and the end-of-training summary (TensorBoard: test_reporting.py)."""

from __future__ import annotations

import math

import torch

from trainer.observe.metrics import MetricsWriter, read_metrics, summary_table


def test_metrics_writer_jsonl(tmp_path):
    writer = MetricsWriter(str(tmp_path), is_main=True)
    writer.write(
        {"step": 1, "epoch": 0.5, "loss": torch.tensor(2.5), "learning_rate": 1e-4, "grad_norm": math.nan}
    )
    # Each row is on disk as soon as it is written.
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 1, "epoch": 0.5, "loss": 2.5, "learning_rate": 0.0001, "grad_norm": null}\n'
    )
    writer.write({"step": 2, "epoch": 1.0, "eval_loss": 2.25})
    writer.close()
    rows = read_metrics(tmp_path)
    assert rows == [
        {"step": 1, "epoch": 0.5, "loss": 2.5, "learning_rate": 0.0001, "grad_norm": None},
        {"step": 2, "epoch": 1.0, "eval_loss": 2.25},
    ]
    # A resumed run appends.
    writer = MetricsWriter(str(tmp_path), is_main=True)
    writer.write({"step": 3, "loss": 2.0})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "runs").exists()


def test_metrics_writer_only_on_main_rank(tmp_path):
    writer = MetricsWriter(str(tmp_path / "out"), is_main=False)
    writer.write({"step": 1, "loss": 1.0})
    writer.close()
    assert not (tmp_path / "out").exists()


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 3.0}]


def test_summary_table():
    rows = [
        {
            "step": 10,
            "loss": 3.0,
            "tokens_per_second": 100.0,
            "total_tokens": 1000,
            "train_time_s": 10.0,
            "mfu": 0.4,
        },
        {"step": 10, "eval_loss": 2.9},
        {
            "step": 20,
            "loss": 2.5,
            "tokens_per_second": 200.0,
            "total_tokens": 3000,
            "train_time_s": 20.0,
            "mfu": 0.5,
        },
        {"step": 20, "eval_loss": 2.95},
    ]
    assert summary_table(rows).splitlines() == [
        "steps             20",
        "train time        0m 20s",
        "tokens            3,000",
        "mean tokens/s     150.0",
        "mean MFU          45.0%",
        "final train loss  2.5000",
        "best eval loss    2.9000 (step 10)",
    ]
    assert summary_table([]) == "no metrics logged"
