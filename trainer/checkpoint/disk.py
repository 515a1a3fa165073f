"""Disk space for checkpoints: what the next one needs, what the filesystem has, and the one line a
run prints when they do not meet.

The expected size is the newest complete checkpoint's (its manifest lists every file's size), or,
before the first, the planner's estimate of what DeepSpeed saves: the weights and the optimizer
states (``trainer.planner.model_state_bytes``; gradients are not saved).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trainer.planner import model_state_bytes


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` or its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def estimated_checkpoint_bytes(n_params: int, precision: str) -> int:
    state = model_state_bytes(n_params, stage=0, dp=1, precision=precision)
    return int(state["params"] + state["optimizer"])


def full_disk(needed: int, source: str, free: int) -> str:
    """The one line for a full disk: the expected size, where it comes from, what is free, what is short."""
    if free >= needed:  # it filled up during a save bigger than expected
        return (
            f"the disk is full: the checkpoint did not fit in the {size(free)} free on the filesystem of "
            f"output_dir (about {size(needed)} expected, {source})"
        )
    return (
        f"the disk is full: a checkpoint needs about {size(needed)} ({source}), and the filesystem of "
        f"output_dir has {size(free)} free: {size(needed - free)} short"
    )


def size(n: float) -> str:
    units = ["bytes", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.0f} bytes" if i == 0 else f"{n:,.1f} {units[i]}"
