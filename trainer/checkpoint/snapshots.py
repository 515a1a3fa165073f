"""Flash snapshots: the whole training state in host shared memory every ``snapshot_steps`` steps.

A snapshot is a checkpoint (the same files, manifest and checksums, the same atomic commit) written
under ``/dev/shm``, so it outlives a crashed process but not the machine. It is written as an
asynchronous save is: the step waits for a copy of the state in host memory, a background thread
writes it, and every rank's "written" rides the step's host vote before it is committed. By the
time the next snapshot is due (and before a checkpoint save or an evaluation begins) it is committed,
waiting for the write if it has not finished: a step never shows before the snapshot of the one
K steps before it is safe. The newest one is kept. After a restart, the resume considers the snapshots with the disk checkpoints
and takes the newest that verifies on every rank (``checkpoint.find_resumable``); where a rank
cannot see it (another node, a node lost), the disk checkpoint is used.

The job's directory goes when training ends. A directory left by a crashed job is swept by a later
start once its output_dir's lock is free and it is older than ``STALE_S`` (a restart comes back well
within that, and finds it).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint.layout import CheckpointWriteError
from trainer.checkpoint.store import Saver
from trainer.runtime.distributed import DistInfo, barrier, warn
from trainer.runtime.ownership import LOCK_FILE

if TYPE_CHECKING:
    from trainer.engine import Engine

SHM = Path("/dev/shm")
PREFIX = f"trainer-snapshots-{os.getuid()}-"
OWNER = "output_dir.txt"  # which output_dir a snapshot directory belongs to
STALE_S = 900.0


def snapshot_dir(output_dir: str | Path) -> Path:
    """The job's snapshot directory: one per output_dir (and user)."""
    key = hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]
    return SHM / f"{PREFIX}{key}"


class Snapshots:
    """Takes the run's snapshots (collective calls, like ``Saver``'s)."""

    def __init__(self, args: Any, dist: DistInfo, ds_config: dict[str, Any], run_config: Any, *hf_files: Any):
        self.dir = snapshot_dir(args.output_dir)
        self.dist = dist
        if dist.local_rank == 0:
            sweep_stale(keep=self.dir)
            self.dir.mkdir(exist_ok=True)
            (self.dir / OWNER).write_text(str(Path(args.output_dir).resolve()))
        shm_args = args.model_copy(
            update={"output_dir": str(self.dir), "async_save": True, "save_total_limit": 1}
        )
        self.saver = Saver(shm_args, dist, ds_config, run_config, *hf_files)

    @property
    def pending(self) -> bool:
        return self.saver.pending

    def take(self, engine: Engine, state: Any, rank_state: dict[str, Any] | None = None) -> None:
        """A snapshot of this step (the loop calls it when one is due); ``rank_state`` as a
        checkpoint keeps it."""
        self._quietly(lambda: self.saver.save(engine, state, rank_state=rank_state))

    def ballot(self) -> list[float]:
        """This rank's part of the step's vote (``trainer.loop.vote``): [1.0] once its part of the
        pending snapshot is written, [0.0] before, [] with none pending."""
        return [float(self.saver.written())] if self.saver.pending else []

    def tally(self, ranks_written: list[float]) -> None:
        """The pending snapshot is committed once every rank has written its part."""
        if ranks_written:
            self._quietly(lambda: self.saver.commit_if_written(ranks_written[0]))

    def settle(self) -> None:
        """Commit the pending snapshot now (collective), waiting for its write if need be: before
        the next one is due, and before a checkpoint save or an evaluation, so a crash anywhere
        finds the previous snapshot committed."""
        self._quietly(self.saver.finish)

    def release(self) -> None:
        """Training ended: the pending one is finished and the directory removed (collective)."""
        self.settle()
        barrier("snapshots:release")
        if self.dist.local_rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _quietly(self, step: Any) -> None:
        try:
            step()
        except CheckpointWriteError as err:  # a snapshot is an optimisation: the run goes on
            warn(f"snapshot skipped: {err}")


def sweep_stale(keep: Path | None = None) -> list[Path]:
    """Remove this user's snapshot directories whose job is gone: its output_dir unlocked (or gone)
    and the directory untouched for STALE_S."""
    removed = []
    for directory in SHM.glob(f"{PREFIX}*"):
        if directory == keep or time.time() - directory.stat().st_mtime < STALE_S:
            continue
        owner = directory / OWNER
        output_dir = Path(owner.read_text().strip()) if owner.is_file() else None
        if output_dir is None or not _locked(output_dir / LOCK_FILE):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def _locked(lock: Path) -> bool:
    """Whether a live process holds this output_dir lock."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken just now
    return False
