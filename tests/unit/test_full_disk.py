"""The note a full disk leaves in output_dir, read at the rerun's door (``trainer.runtime.full_disk``);
the whole path, a tmpfs filled by a real save, is in ``tests/e2e/test_disk_full.py``."""

from __future__ import annotations

import errno
import json

import pytest

from trainer.runtime import full_disk
from trainer.runtime.full_disk import SLACK_BYTES, free_bytes, note_full_disk, still_full
from trainer.runtime.run_files import write_whole


def test_a_checkpoint_refused_before_writing_needs_its_expected_bytes(tmp_path):
    free = free_bytes(tmp_path)
    note_full_disk(tmp_path, "checkpoint-6", expected=free + (1 << 40), free=free)
    assert json.loads((tmp_path / "full_disk.json").read_text())["checkpoint"] == "checkpoint-6"
    line = still_full(tmp_path, is_main=True)
    assert line.startswith(
        "the disk is still full: checkpoint-6 was not saved for lack of space, it needs about "
    )
    assert (tmp_path / "full_disk.json").exists()


def test_a_checkpoint_that_filled_the_disk_needs_more_than_was_free(tmp_path):
    free = free_bytes(tmp_path)
    note_full_disk(tmp_path, "checkpoint-2", expected=1, free=free + (1 << 40))
    assert "it needs more than the " in still_full(tmp_path, is_main=True)


@pytest.mark.parametrize("gained", [0, 4096, SLACK_BYTES - 1])
def test_a_few_pages_more_than_the_save_had_are_not_room(tmp_path, monkeypatch, gained):
    """A checkpoint that filled the disk: the run's own small files (its lock, the note) move the free
    space by a page or two before the rerun, which would not hold the checkpoint either."""
    note_full_disk(tmp_path, "checkpoint-4", expected=50 << 20, free=64 << 20)
    monkeypatch.setattr(full_disk, "free_bytes", lambda path: (64 << 20) + gained)
    assert "it needs more than the 64.0 MiB it did not fit in" in still_full(tmp_path, is_main=True)
    monkeypatch.setattr(full_disk, "free_bytes", lambda path: (64 << 20) + SLACK_BYTES)
    assert still_full(tmp_path, is_main=True) is None


def test_once_there_is_room_rank_0_removes_the_note(tmp_path):
    note_full_disk(tmp_path, "checkpoint-2", expected=1, free=0)
    assert still_full(tmp_path, is_main=False) is None
    assert (tmp_path / "full_disk.json").exists()  # another rank only reads it
    assert still_full(tmp_path, is_main=True) is None
    assert not (tmp_path / "full_disk.json").exists()
    assert still_full(tmp_path, is_main=True) is None  # no note, no refusal


def test_a_note_the_disk_has_no_room_for_leaves_no_partial_file(tmp_path):
    """``write_whole`` removes its partial file when the write fails (here: a full disk's ENOSPC)."""

    def full(path):
        path.write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(tmp_path / "full_disk.json", full)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["{", "[]", '{"checkpoint": "checkpoint-2"}'])
def test_a_note_that_is_not_one_of_ours_refuses_nothing(tmp_path, text):
    (tmp_path / "full_disk.json").write_text(text)
    assert still_full(tmp_path, is_main=True) is None
