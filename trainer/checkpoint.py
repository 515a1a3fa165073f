"""Checkpoint directories: layout, atomic commit, discovery, verification, rotation, HF export.

``output_dir/checkpoint-<step>/`` holds::

    ds/                     DeepSpeed's own state (model, optimizer and scheduler shards)
    trainer_state.json      TrainerState, including the data position
    rng_state_<rank>.pt     python/numpy/torch RNG states of each rank (tensors and lists only)
    ds_config.json          the DeepSpeed config that wrote it
    run_config.yaml         the resolved run config
    manifest.json           size and sha256 of every file above, plus world size and ZeRO stage
    COMPLETE                the commit marker: written last, after the rename

A checkpoint is written into ``.staging-checkpoint-<step>``; once every rank has voted that its part
is on disk, rank 0 writes the manifest, renames the directory and writes the marker. A directory
without the marker is never loaded, counted or kept by rotation.
"""

from __future__ import annotations

import hashlib
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

from trainer.args import RunConfig, TrainingArguments, dump_run_config
from trainer.callbacks import TrainerState
from trainer.distributed import DistInfo, all_agree, barrier, warn

PREFIX = "checkpoint-"
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
STAGING = ".staging-"
DS_TAG = "ds"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    pass


# ---- discovery -----------------------------------------------------------------------------------


def step_of(path: Path) -> int | None:
    m = _STEP.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / MANIFEST).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p) or 0)


# ---- manifest ------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _payload_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER) and p.suffix != ".py"
    )


def write_manifest(root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    files = _payload_files(root)
    with ThreadPoolExecutor(max_workers=4) as pool:
        digests = list(pool.map(_sha256, files))
    entries = {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests, strict=True)
    }
    manifest = {**meta, "files": entries}
    _write_durable(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({err})") from None


def verify(path: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """Problems with this rank's share of the files (every world_size-th one, so all are covered)."""
    manifest = read_manifest(path)
    problems = []
    for i, (name, entry) in enumerate(sorted(manifest["files"].items())):
        if i % world_size != rank:
            continue
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{file}: size {file.stat().st_size} != manifest {entry['size']}")
        elif _sha256(file) != entry["sha256"]:
            problems.append(f"{file}: checksum does not match the manifest")
    return problems


# ---- commit and rotation (rank 0) ----------------------------------------------------------------


def staging_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{STAGING}{PREFIX}{step}"


def final_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"{PREFIX}{step}"


def _write_durable(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, final: Path, meta: dict[str, Any]) -> None:
    """Manifest, rename, marker: after this returns the checkpoint is complete and durable."""
    write_manifest(staging, meta)
    if final.exists():
        # Only an uncommitted leftover (or a re-save of the same step) can be here: replace it.
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    _write_durable(final / MARKER, "ok\n")
    _fsync_dir(final)


def rotate(output_dir: str | Path, limit: int | None, keep: set[Path]) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``; never the newest or those in ``keep``."""
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
    root = Path(output_dir)
    if root.is_dir():
        for p in root.glob(f"{STAGING}*"):
            shutil.rmtree(p, ignore_errors=True)


# ---- RNG state (every rank) ----------------------------------------------------------------------


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


def load_rng(directory: Path, rank: int) -> None:
    path = directory / f"rng_state_{rank}.pt"
    if path.is_file():
        set_rng_state(torch.load(path, weights_only=True))


# ---- save and load (collective: every rank calls these) -----------------------------------------


def save(
    engine: Any,
    state: TrainerState,
    args: TrainingArguments,
    dist: DistInfo,
    ds_config: dict[str, Any],
    run_config: RunConfig | None,
) -> Path:
    """Write ``checkpoint-<step>`` through a staging directory and commit it once all ranks agree."""
    staging, final = staging_dir(args.output_dir, state.global_step), final_dir(args.output_dir, state.global_step)
    if is_complete(final):
        return final  # this step is already saved (a final save landing on a save_steps multiple)
    if dist.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier("save:prepare")
    ok = True
    try:
        engine.save(str(staging), DS_TAG, client_state={"global_step": state.global_step})
        save_rng(staging, dist.rank)
        if dist.is_main:
            state.save_to_json(staging / "trainer_state.json")
            (staging / "ds_config.json").write_text(json.dumps(ds_config, indent=2, sort_keys=True))
            if run_config is not None:
                dump_run_config(run_config, staging / "run_config.yaml")
    except OSError as err:
        warn(f"{staging}: could not write checkpoint ({err})")
        ok = False
    # Every rank votes that its files are on disk before rank 0 commits.
    if not all_agree(ok):
        raise CheckpointError(f"{staging}: a rank failed to write its part; not committed")
    if dist.is_main:
        meta = {
            "step": state.global_step,
            "world_size": dist.world_size,
            "zero_stage": ds_config.get("zero_optimization", {}).get("stage", 0),
        }
        commit(staging, final, meta)
        keep = {Path(state.best_model_checkpoint)} if state.best_model_checkpoint else set()
        rotate(args.output_dir, args.save_total_limit, keep=keep)
    barrier("save:commit")
    return final


def find_resumable(spec: str | bool | None, output_dir: str | Path, dist: DistInfo) -> Path | None:
    """The checkpoint to resume from: ``auto``/True = newest complete one that verifies on every
    rank, falling back to older ones with a warning; a path = that one, or an error."""
    if spec in (None, False, ""):
        return None
    if spec in (True, "auto"):
        candidates = list(reversed(complete_checkpoints(output_dir)))
        if not candidates:
            if dist.is_main:
                print(f"No complete checkpoint in {output_dir}; starting from scratch.", flush=True)
            return None
    else:
        path = Path(spec)
        if not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint (no {MARKER} marker or manifest)")
        candidates = [path]
    for path in candidates:
        problems = verify(path, dist.rank, dist.world_size)
        if all_agree(not problems):
            return path
        for problem in problems:
            warn(problem)
        warn(f"{path}: failed verification; trying the previous checkpoint")
    raise CheckpointError(f"no loadable checkpoint among {[str(p) for p in candidates]}")


def load(engine: Any, path: Path, dist: DistInfo, restore_rng: bool = True) -> TrainerState:
    saved_world = read_manifest(path).get("world_size")
    if saved_world != dist.world_size:
        raise CheckpointError(
            f"{path}: saved on {saved_world} ranks, resuming on {dist.world_size}; "
            "a world-size change needs a universal checkpoint conversion"
        )
    engine.load(str(path), DS_TAG, load_optimizer_states=True)
    if restore_rng:
        load_rng(path, dist.rank)
    return TrainerState.load_from_json(path / "trainer_state.json")


# ---- HF export -----------------------------------------------------------------------------------


def export_hf(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], tokenizer: Any, out_dir: str | Path) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer).

    Files are written into a staging directory first and then moved in one by one, so a crash never
    leaves a truncated weights file, and other contents of ``out_dir`` (e.g. output_dir) are kept.
    """
    out = Path(out_dir)
    tmp = out.parent / f"{STAGING}export-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    out.mkdir(parents=True, exist_ok=True)
    for file in tmp.iterdir():
        os.replace(file, out / file.name)
    tmp.rmdir()
    return out
