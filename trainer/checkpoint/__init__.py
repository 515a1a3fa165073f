"""Checkpoints: the save, commit, retention and resume of a run (``store``), each rank's file writer
(``writer``), in-memory snapshots (``snapshots``), free-space checks (``disk``) and HF exports
(``export``).
"""

from trainer.checkpoint.layout import (
    DS_TAG,
    MARKER,
    STAGING,
    WEIGHTS,
    CheckpointError,
    CheckpointWriteError,
    commit,
    complete_checkpoints,
    final_dir,
    is_complete,
    load_rng,
    read_manifest,
    remove_stale_staging,
    rotate,
    save_rng,
    staging_dir,
    verify,
    write_manifest,
)
from trainer.checkpoint.resume import (
    accumulation_for,
    find_resumable,
    load,
    needs_universal,
    resumable,
    run_config_changes,
    steps_left,
    uncarried,
    universal_copy,
)
from trainer.checkpoint.store import (
    Saver,
)

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "DS_TAG",
    "MARKER",
    "STAGING",
    "Saver",
    "WEIGHTS",
    "accumulation_for",
    "commit",
    "complete_checkpoints",
    "final_dir",
    "find_resumable",
    "is_complete",
    "load",
    "load_rng",
    "needs_universal",
    "read_manifest",
    "remove_stale_staging",
    "resumable",
    "rotate",
    "run_config_changes",
    "save_rng",
    "staging_dir",
    "steps_left",
    "uncarried",
    "universal_copy",
    "verify",
    "write_manifest",
]
