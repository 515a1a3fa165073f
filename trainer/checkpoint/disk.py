"""Disk space for checkpoints: what the next one needs, what the filesystem has, and the one line a
run prints when they do not meet.

The expected size is the newest complete checkpoint's (its manifest lists every file's size), or,
before the first, the planner's estimate of what DeepSpeed saves: the weights and the optimizer
states (``trainer.planner.model_state_bytes``; gradients are not saved).
"""

from __future__ import annotations

from trainer.planner import model_state_bytes
from trainer.runtime.full_disk import free_bytes, size

__all__ = ["estimated_checkpoint_bytes", "free_bytes", "full_disk", "size"]


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
