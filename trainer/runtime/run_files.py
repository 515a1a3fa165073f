"""The names of what a run writes at the top of ``output_dir`` (the contract in DESIGN.md): one home,
so the writers, the readers and the tools agree. Checkpoint directories' own layout lives with them
(``trainer.checkpoint.store``). Also how a file is written whole or not at all (``write_whole``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

DS_CONFIG = "ds_config.json"  # the resolved DeepSpeed config the run used
RUN_CONFIG = "run_config.yaml"  # the whole run's arguments, as a recipe that reproduces it
METRICS = "metrics.jsonl"  # one JSON row per logging step and evaluation
FINAL = "final"  # the HF export of the finished run
FULL_DISK = "full_disk.json"  # the last stop was a save a full disk refused (trainer.runtime.full_disk)


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` whole or not at all: ``write`` fills a file of this process's own beside it,
    which is synced and renamed into place. A reader (another rank too) never sees half a file, and
    a crash leaves the old file or none."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
        with partial.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        raise
