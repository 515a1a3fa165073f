"""A checkpoint directory's files and names, and what is done to it on disk: discovery, the
manifest and its verification, the atomic commit, rotation, and the RNG state files.

``Saver`` (``trainer/checkpoint/store.py``) writes checkpoints; ``trainer/checkpoint/resume.py``
finds, verifies and loads them. Both use the names and steps here. The layout itself is described
in ``trainer/checkpoint/store.py``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.checkpoint.writer import file_entry
from trainer.runtime.digests import HASHES, file_digest
from trainer.runtime.distributed import DistInfo, all_gather_object
from trainer.runtime.run_files import write_whole

PREFIX = "checkpoint-"
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
STAGING = ".staging-"
DISK_FULL_BYTES = 1 << 20  # free space below this when a write failed: the disk was full
DS_TAG = "ds"
WEIGHTS = "model.safetensors"  # a save_only_model checkpoint's weights
UNIVERSAL = "universal"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")
# ZeRO (1-3) and the bf16 optimizer shard optimizer states per data-parallel rank in these files.
_OPTIM_SHARD = re.compile(rf"^{DS_TAG}/.*optim_states\.pt$")


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from or exported; the message names the file.

    Not a config problem, but bad input all the same: the entry points catch it next to ConfigError,
    print it as one line and exit with the bad-input status. ``str()`` names the setting that chose
    the checkpoint, ``resume_from_checkpoint: <message>``, as a config problem would.
    """

    KEY = "resume_from_checkpoint"

    def __init__(self, message: str):
        self.message = message
        super().__init__(f"{self.KEY}: {message}")


class CheckpointWriteError(RuntimeError):
    """A rank could not write its part of a checkpoint; nothing was committed. ``full_disk``: its
    name, the bytes it was expected to take and the bytes free, where the disk was full (rank 0
    knows)."""

    def __init__(self, message: str, full_disk: tuple[str, int, int] | None = None):
        super().__init__(message)
        self.full_disk = full_disk


# ---- discovery -----------------------------------------------------------------------------------


def step_of(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / MANIFEST).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Committed checkpoints, oldest first. Staging and unmarked directories are not listed."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


# ---- manifest ------------------------------------------------------------------------------------


def _payload_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER) and p.suffix != ".py"
    )


def write_manifest(
    root: Path, meta: dict[str, Any], known: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Size and checksum of every payload file. ``known`` holds the records the writing ranks took
    (their files are already fsynced); any other file is checksummed and fsynced here."""
    known = known or {}
    files = {str(p.relative_to(root)): p for p in _payload_files(root)}
    rest = [name for name in files if name not in known or known[name]["size"] != files[name].stat().st_size]
    with ThreadPoolExecutor(max_workers=4) as pool:
        computed = dict(zip(rest, pool.map(lambda name: file_entry(files[name]), rest), strict=True))
    entries = {name: computed.get(name) or known[name] for name in sorted(files)}
    manifest = {**meta, "files": entries}
    _write_durable(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path / MANIFEST}: not a checkpoint manifest (no file list)")
    return manifest


def verify(path: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """Problems with this rank's share of the files (every world_size-th one, so all are covered)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        return [err.message]
    names = sorted(manifest["files"])[rank::world_size]
    return [problem for name in names if (problem := _problem(path / name, manifest["files"][name]))]


def _problem(file: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with one file against its manifest entry. The sum is xxh3-128, or sha256 in
    manifests written before it; an entry with neither is refused, naming the file."""
    if not file.is_file():
        return f"{file}: missing"
    if file.stat().st_size != entry["size"]:
        return f"{file}: size {file.stat().st_size} bytes, the manifest says {entry['size']}"
    algorithm = next((name for name in HASHES if name in entry), None)
    if algorithm is None:
        return f"{file}: the manifest has no checksum for it (expected one of: {', '.join(HASHES)})"
    if file_digest(file, algorithm) != entry[algorithm]:
        return f"{file}: checksum does not match the manifest"
    return None


def verify_on_all_ranks(path: Path, dist: DistInfo) -> list[str]:
    """Every rank checks its share; every rank gets the problems of all (sorted, so all agree)."""
    mine = verify(path, dist.rank, dist.world_size)
    return sorted({p for part in all_gather_object(mine) for p in part})


# ---- commit and rotation (rank 0) ----------------------------------------------------------------


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{STAGING}{PREFIX}{step}"


def final_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step}"


def _write_durable(path: Path, text: str) -> None:
    write_whole(path, lambda partial: partial.write_text(text))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(
    staging: Path, final: Path, meta: dict[str, Any], known: dict[str, dict[str, Any]] | None = None
) -> None:
    """Manifest, rename, marker: after this returns the checkpoint is complete and durable."""
    write_manifest(staging, meta, known)
    if final.exists():
        # An uncommitted leftover, or this step saved by an earlier run that resumed from an older
        # checkpoint (maybe because this one failed verification): replaced. The marker goes first,
        # so a crash in between leaves a directory that is ignored, never a half-deleted "complete" one.
        (final / MARKER).unlink(missing_ok=True)
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    _write_durable(final / MARKER, "ok\n")
    _fsync_dir(final)


def rotate(output_dir: str | Path, limit: int | None, keep: set[Path]) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``; never the newest or those in ``keep``
    (the best one). Protected checkpoints count towards the limit, so fewer others are kept."""
    if not limit:
        return []
    ckpts = complete_checkpoints(output_dir)
    protected = {p.resolve() for p in keep} | ({ckpts[-1].resolve()} if ckpts else set())
    removable = [p for p in ckpts if p.resolve() not in protected]
    excess = len(ckpts) - limit
    deleted = removable[: max(excess, 0)]
    for path in deleted:
        # Drop the marker first: a half-deleted directory must never look complete.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def remove_stale_staging(output_dir: str | Path) -> None:
    """Leftovers of saves that never committed (a crash mid-save); only rank 0 calls this."""
    root = Path(output_dir)
    if root.is_dir():
        for p in root.glob(f"{STAGING}{PREFIX}*"):
            shutil.rmtree(p, ignore_errors=True)


# ---- RNG state (every rank) ----------------------------------------------------------------------


RNG_KEYS = ("python", "numpy", "torch", "cuda")


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain lists, so they load with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(directory: Path, rank: int) -> None:
    torch.save(rng_state(), directory / f"rng_state_{rank}.pt")


def load_rng(directory: Path, rank: int) -> dict[str, Any]:
    """Restore this rank's RNG; a rank the checkpoint did not have keeps its seeded state. Returns
    what else the rank kept in the file ({} where none)."""
    path = directory / f"rng_state_{rank}.pt"
    if not path.is_file():
        return {}
    state = torch.load(path, weights_only=True)
    set_rng_state(state)
    return {k: v for k, v in state.items() if k not in RNG_KEYS}
