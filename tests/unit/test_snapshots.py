"""Flash snapshot housekeeping: which shared-memory directories a start sweeps, and how resume
candidates from disk and memory are ordered."""

from __future__ import annotations

import os
import time

from tests.unit.test_ownership import hold
from trainer import checkpoint as ckpt
from trainer.checkpoint import snapshots
from trainer.checkpoint.resume import _candidates


def committed(root, step):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    ckpt.write_manifest(path, {"step": step})
    (path / ckpt.MARKER).write_text("ok")
    return path


def old_snapshot_dir(shm, name, output_dir, age_s=3600):
    directory = shm / f"{snapshots.PREFIX}{name}"
    directory.mkdir()
    (directory / snapshots.OWNER).write_text(str(output_dir))
    os.utime(directory, (time.time() - age_s, time.time() - age_s))
    return directory


def test_a_start_sweeps_only_the_snapshots_of_jobs_that_are_gone(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(snapshots, "SHM", shm)
    live_dir = tmp_path / "live"
    holder = hold(live_dir, 60)  # a running job holds its output_dir
    try:
        gone = old_snapshot_dir(shm, "gone", tmp_path / "finished")  # no lock held: swept
        live = old_snapshot_dir(shm, "live", live_dir)
        fresh = old_snapshot_dir(shm, "fresh", tmp_path / "crashed", age_s=10)  # a restart may want it
        mine = old_snapshot_dir(shm, "mine", tmp_path / "mine")
        assert snapshots.sweep_stale(keep=mine) == [gone]
        assert live.exists() and fresh.exists() and mine.exists() and not gone.exists()
    finally:
        holder.kill()
        holder.wait()


def test_resume_candidates_are_the_newest_first_disk_before_memory(tmp_path):
    disk, shm = tmp_path / "out", tmp_path / "shm"
    committed(disk, 4), committed(disk, 8), committed(shm, 8), committed(shm, 9)
    assert _candidates(disk, shm) == [shm / "checkpoint-9", disk / "checkpoint-8", shm / "checkpoint-8",
                                           disk / "checkpoint-4"]  # fmt: skip
    assert _candidates(disk, None) == [disk / "checkpoint-8", disk / "checkpoint-4"]
