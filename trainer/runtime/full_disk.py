"""A run stopped by a full disk, met again at the door of its rerun.

When a checkpoint cannot be saved for lack of space and ``save_failure_policy`` is ``stop`` (exit
74), rank 0 leaves ``output_dir/full_disk.json``: the checkpoint, the bytes it was expected to take
and the bytes free once its partial files were removed. A rerun reads it before torch loads: while
the filesystem has not gained the space since, it stops at once with the same exit code and one
line, instead of importing, resuming and training up to the same save to fail it again (what each of
``torchrun --max-restarts``'s restarts would do). Once the space is there, the note is removed and the
run goes on. Nothing here imports torch.
"""

from __future__ import annotations

import json
import shutil
from contextlib import suppress
from pathlib import Path

from trainer.runtime.run_files import FULL_DISK, write_whole

# The run's own small files (its lock, this note, a metrics row) move the free space by a few pages
# between the failed save and the rerun's door, either way: a gain below this is not space freed.
SLACK_BYTES = 1 << 20


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` or its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def size(n: float) -> str:
    units = ["bytes", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.0f} bytes" if i == 0 else f"{n:,.1f} {units[i]}"


def note_full_disk(output_dir: str | Path, checkpoint: str, expected: int, free: int) -> None:
    """Rank 0, as the run stops on a full disk. A disk too full for these few bytes gets no note."""
    note = {"checkpoint": checkpoint, "expected_bytes": expected, "free_bytes": free}
    with suppress(OSError):
        write_whole(Path(output_dir) / FULL_DISK, lambda path: path.write_text(json.dumps(note)))


def still_full(output_dir: str | Path, is_main: bool) -> str | None:
    """The door's line when the last stop in ``output_dir`` was a full disk and the filesystem still
    lacks the space: at least what the checkpoint was expected to take, and more than was free when it
    did not fit (by ``SLACK_BYTES``). None otherwise; then rank 0 (``is_main``) removes the note."""
    path = Path(output_dir) / FULL_DISK
    try:
        note = json.loads(path.read_text())
        checkpoint, expected, was_free = (
            note["checkpoint"],
            int(note["expected_bytes"]),
            int(note["free_bytes"]),
        )
    except (OSError, ValueError, KeyError, TypeError):  # no note, or not one of ours: no refusal
        return None
    free = free_bytes(output_dir)
    if free >= max(expected, was_free + SLACK_BYTES):
        if is_main:
            path.unlink(missing_ok=True)
        return None
    needs = (
        f"about {size(expected)}"
        if expected > was_free
        else f"more than the {size(was_free)} it did not fit in"
    )
    return (
        f"the disk is still full: {checkpoint} was not saved for lack of space, it needs {needs}, "
        f"and the filesystem of output_dir has {size(free)} free (output_dir/{FULL_DISK}). Free space, "
        "then rerun: it resumes from the newest complete checkpoint."
    )
