"""scripts/bench_checkpoint.py on 2 ranks (ZeRO-2, a tiny Llama): the report's contract and that the
checkpoints it timed are real, complete ones. Timings are never asserted."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch import launch
from trainer import checkpoint as ckpt
from trainer.checkpoint.snapshots import snapshot_dir

pytestmark = pytest.mark.distributed


def test_reports_save_and_raw_speeds_and_blocked_times(tmp_path):
    out, report_file = tmp_path / "bench", tmp_path / "report.json"
    args = ["--hidden_size", "64", "--layers", "2", "--vocab_size", "512", "--zero_stage", "2"]
    proc = launch(
        [
            "scripts/bench_checkpoint.py",
            *args,
            "--repeats",
            "2",
            "--out",
            str(out),
            "--json",
            str(report_file),
        ]
    )
    report = json.loads(report_file.read_text())
    assert report["world_size"] == 2 and report["zero_stage"] == 2 and report["repeats"] == 2
    for key in ("raw_write_gbps", "sync_save_gbps", "async_save_gbps"):
        assert report[key] > 0, key
    for mode in ("sync", "async", "snapshot"):
        assert 0 < report[mode]["blocked_s"] <= report[mode]["total_s"], mode
    # One paired ratio per round (the plain write next to the sync save); their median is reported.
    rounds = report["save_vs_raw_rounds"]
    assert len(rounds) == 2 and all(r > 0 for r in rounds)
    assert report["save_vs_raw"] == pytest.approx(sum(rounds) / 2)
    # Six saves were timed: snapshot, async, sync, then sync, async, snapshot. The snapshots went to
    # /dev/shm (gone once the bench ends); the old checkpoints were removed outside the timing, and
    # the last one written to --out (step 5, the second round's async save) is complete.
    (last,) = ckpt.complete_checkpoints(out)
    assert last.name == "checkpoint-5" and ckpt.verify(last) == []
    assert not snapshot_dir(out).exists()
    manifest = ckpt.read_manifest(last)
    assert report["checkpoint_bytes"] == sum(e["size"] for e in manifest["files"].values())
    assert any(name.endswith("optim_states.pt") for name in manifest["files"])  # one shard per rank
    assert "async save: loop blocked" in proc.stdout and "snapshot (/dev/shm): loop blocked" in proc.stdout
