"""Checkpoint directories: layout, atomic commit, discovery, verification, rotation, universal
conversion for a new world size. HF exports are trainer/checkpoint/export.py's.

``output_dir/checkpoint-<step>/`` holds::

    ds/                     DeepSpeed's own state (model, optimizer and scheduler shards)
    trainer_state.json      TrainerState, including the data position
    rng_state_<rank>.pt     python/numpy/torch RNG states of each rank (tensors and lists only)
    ds_config.json          the DeepSpeed config that wrote it
    run_config.yaml         the resolved run config
    manifest.json           size and sha256 of every file above, plus world size, ZeRO stage, batch
    COMPLETE                the commit marker: written last, after the rename
    universal/              only after a resume on another world size: DeepSpeed's universal form
                            of ds/, committed the same way (its own manifest and marker)

With ``save_only_model`` (HF's meaning) a checkpoint holds ``model.safetensors`` (the whole model's
weights, as the export writes them) in place of ``ds/`` and the RNG states: an HF model directory
that ``load_best_model_at_end`` and ``trainer export`` read, which no run can resume from.

A checkpoint is written into ``.staging-checkpoint-<step>``; once every rank has voted that its part
is on disk, rank 0 writes the manifest, renames the directory and writes the marker. A directory
without the marker is never loaded, counted or kept by rotation. Before anything is loaded, every
rank checksums its share of the files against the manifest: DeepSpeed unpickles its shards with
``torch.load(weights_only=False)``, so only verified bytes may reach it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from deepspeed.checkpoint import ds_to_universal
from safetensors.torch import load_file

from trainer.args import DataArguments, ModelArguments, RunConfig, TrainingArguments
from trainer.args.recipe import dump_run_config
from trainer.checkpoint import disk
from trainer.checkpoint.writer import FileWriter, file_entry, save_weights
from trainer.config.files import precision_of
from trainer.runtime.distributed import DistInfo, all_gather_object, barrier, warn
from trainer.runtime.state import TrainerState

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
    """A rank could not write its part of a checkpoint; nothing was committed."""


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


# ---- what a resume continues -----------------------------------------------------------------

# Data fields that change neither the model nor the training data: evaluation size and caching.
_SAFE_DATA_FIELDS = {"max_eval_samples", "preprocessing_num_workers", "cache_dir"}


def run_config_changes(checkpoint: Path, run: RunConfig) -> tuple[list[str], list[str]]:
    """How ``run`` differs from the run that wrote ``checkpoint``: (fields of the model, tokenizer
    or training data, which a resume must refuse; other fields, which it may take on).
    Nothing is compared when the checkpoint holds no run config (written through the Trainer API);
    a field the saved config lacks (one added since it was written) counts as its default there."""
    saved_file = checkpoint / "run_config.yaml"
    if not saved_file.is_file():
        return [], []
    saved, current = yaml.safe_load(saved_file.read_text()) or {}, run.to_flat()
    defaults = {
        name: spec.default
        for model in (TrainingArguments, ModelArguments, DataArguments)
        for name, spec in model.model_fields.items()
    }
    changed = sorted(
        k for k in saved.keys() | current.keys() if saved.get(k, defaults.get(k)) != current.get(k)
    )
    guarded = (set(ModelArguments.model_fields) | set(DataArguments.model_fields)) - _SAFE_DATA_FIELDS
    return [k for k in changed if k in guarded], [k for k in changed if k not in guarded]


def steps_left(checkpoint: Path, args: TrainingArguments) -> int | None:
    """Optimizer steps a resume from ``checkpoint`` would still train; None when only the data can
    tell (an epoch-based run whose epoch count changed)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if args.max_steps > 0:
        target = args.max_steps
    elif state["num_train_epochs"] == math.ceil(args.num_train_epochs):
        target = state["max_steps"]
    else:
        return None
    return max(target - state["global_step"], 0)


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


def write_manifest(
    root: Path, meta: dict[str, Any], known: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Size and sha256 of every payload file. ``known`` holds the records the writing ranks took
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
    problems = []
    for i, (name, entry) in enumerate(sorted(manifest["files"].items())):
        if i % world_size != rank:
            continue
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{file}: size {file.stat().st_size} bytes, the manifest says {entry['size']}")
        elif _sha256(file) != entry["sha256"]:
            problems.append(f"{file}: checksum does not match the manifest")
    return problems


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
    """Restore this rank's RNG; a rank the checkpoint did not have keeps its seeded state."""
    path = directory / f"rng_state_{rank}.pt"
    if path.is_file():
        set_rng_state(torch.load(path, weights_only=True))


# ---- save (collective: every rank calls it) ------------------------------------------------------


class Saver:
    """Writes ``checkpoint-<step>`` directories for one run. Every call is collective.

    A save goes into a staging directory; once every rank's files are on disk, each rank's file
    records are gathered (that is the vote) and rank 0 writes the manifest, renames the directory
    and writes the marker. Synchronous saves commit before ``save`` returns. Asynchronous ones
    (``async_save``) return once the state is in host memory; the commit happens in the first
    ``commit_if_written`` after every rank's writer is done, or in ``finish``. One save is in flight
    at a time: a new save finishes the previous one first.
    """

    def __init__(
        self,
        args: TrainingArguments,
        dist: DistInfo,
        ds_config: dict[str, Any],
        run_config: RunConfig | None,
        model_config: Any = None,
        tokenizer: Any = None,
    ):
        self.args, self.dist, self.ds_config, self.run_config = args, dist, ds_config, run_config
        # An HF model's config and tokenizer go into every checkpoint, as HF's Trainer does, so
        # `trainer export` can rebuild the model from the checkpoint alone.
        self.hf_files = [x for x in (model_config, tokenizer) if hasattr(x, "save_pretrained")]
        self._pending: tuple[FileWriter, Path, Path, dict[str, Any], set[Path]] | None = None
        self._expected: tuple[int, str] = (0, "")  # the pending save's expected size, and its source

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def written(self) -> bool:
        """This rank's part of the pending save is on disk (or failed); local, no communication."""
        return self._pending is None or self._pending[0].done()

    def save(
        self,
        engine: Any,
        state: TrainerState,
        on_written: Callable[[], None] | None = None,
        model_only: bool = False,
    ) -> Path | None:
        """Start ``checkpoint-<step>``; returns it once committed (synchronous saves), else None.
        ``on_written`` runs on each rank once its files are handed to the writer (fault injection).
        ``model_only`` (``save_only_model``): the weights alone, without DeepSpeed's optimizer and
        scheduler states or the RNG states."""
        self.finish()
        args, dist = self.args, self.dist
        staging, final = (
            staging_dir(args.output_dir, state.global_step),
            final_dir(args.output_dir, state.global_step),
        )
        self._expected = self._expected_size(engine)
        room = disk.free_bytes(args.output_dir) >= self._expected[0] if dist.is_main else True
        if not all(all_gather_object(room)):  # every rank learns rank 0's answer
            raise CheckpointWriteError(f"{final.name} not saved: {self._full_disk()}")
        if dist.is_main:
            remove_stale_staging(args.output_dir)
            staging.mkdir(parents=True)
        barrier("save:prepare")
        writer = FileWriter(staging, asynchronous=args.async_save)
        try:
            if model_only:
                save_weights(engine.full_state_dict(), staging / WEIGHTS)  # collective; rank 0 writes
            else:
                engine.save(
                    str(staging), DS_TAG, client_state={"global_step": state.global_step}, writer=writer
                )
                writer.save(rng_state(), staging / f"rng_state_{dist.rank}.pt")
            if dist.is_main:
                writer.write_text(staging / "trainer_state.json", state.to_json())
                writer.write_text(
                    staging / "ds_config.json", json.dumps(self.ds_config, indent=2, sort_keys=True)
                )
                if self.run_config is not None:
                    dump_run_config(self.run_config, staging / "run_config.yaml")
                for item in self.hf_files:
                    item.save_pretrained(staging)
        except Exception as err:  # torch.save and tokenizers raise RuntimeError/Exception for OS errors
            warn(f"{staging}: could not write checkpoint ({err})")
            writer.failed = err
        if on_written is not None:
            on_written()
        meta = {
            "step": state.global_step,
            "world_size": dist.world_size,
            "data_parallel_size": getattr(engine, "world_size", dist.world_size),
            "optimizer_partitions": _partitions(engine, dist),
            "zero_stage": self.ds_config.get("zero_optimization", {}).get("stage", 0),
            "train_batch_size": self.ds_config.get("train_batch_size"),
            "micro_batch_size": self.ds_config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": self.ds_config.get("gradient_accumulation_steps"),
            "model_only": model_only,
        }
        best = {Path(state.best_model_checkpoint)} if state.best_model_checkpoint else set()
        self._pending = (writer, staging, final, meta, best)
        return None if args.async_save else self.finish()

    def commit_if_written(self, ranks_written: float) -> Path | None:
        """Commit the pending save if every rank has voted its part written (a sum over ranks)."""
        if self._pending is not None and ranks_written >= self.dist.world_size:
            return self.finish()
        return None

    def finish(self) -> Path | None:
        """Wait for this rank's pending writes, gather every rank's records, commit on rank 0.
        Returns the committed checkpoint, or None if nothing was pending."""
        if self._pending is None:
            return None
        writer, staging, final, meta, best = self._pending
        self._pending = None
        try:
            vote = writer.wait()
            if writer.failed is not None:
                vote = f"rank {self.dist.rank}: {writer.failed}"
        except Exception as err:  # any failure is a "no" vote; raising here would hang the others
            warn(f"{staging}: could not write checkpoint ({err})")
            vote = f"rank {self.dist.rank}: {err}"
        gathered = all_gather_object(vote)
        # Every rank votes with its file records: one failure and nothing is committed.
        failures = [part for part in gathered if isinstance(part, str)]
        if failures:
            self._abort(staging, final, failures[0])
        if self.dist.is_main:
            known = {name: entry for part in gathered for name, entry in part.items()}
            commit(staging, final, meta, known)
            rotate(self.args.output_dir, self.args.save_total_limit, keep=best)
        barrier("save:commit")
        return final

    def _abort(self, staging: Path, final: Path, failure: str) -> None:
        """A failed save: rank 0 removes the staging directory (complete checkpoints are untouched),
        then every rank raises. A filesystem with (almost) nothing left when it failed was full."""
        full = False
        if self.dist.is_main:
            full = disk.free_bytes(staging) < DISK_FULL_BYTES
            shutil.rmtree(staging, ignore_errors=True)
        barrier("save:abort")
        reason = self._full_disk() if full else failure
        raise CheckpointWriteError(f"{final.name} not saved: {reason}; its partial files were removed")

    def _expected_size(self, engine: Any) -> tuple[int, str]:
        """Bytes the next checkpoint takes, and where that figure comes from."""
        done = complete_checkpoints(self.args.output_dir)
        if done:
            with contextlib.suppress(CheckpointError):
                files = read_manifest(done[-1])["files"].values()
                return sum(entry["size"] for entry in files), f"the size of {done[-1].name}"
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        estimate = disk.estimated_checkpoint_bytes(n_params, precision_of(self.ds_config))
        return estimate, "estimated: weights and optimizer states"

    def _full_disk(self) -> str:
        needed, source = self._expected
        return disk.full_disk(needed, source, disk.free_bytes(self.args.output_dir))


# ---- resume (collective) -------------------------------------------------------------------------


def resumable(path: Path) -> bool:
    """Whether a run can resume from ``path``: every checkpoint but a ``save_only_model`` one."""
    return not read_manifest(path).get("model_only", False)


def refuse_model_only(path: Path | None) -> Path | None:
    """``path``, unless it is a ``save_only_model`` checkpoint, which a resume refuses as HF's does."""
    if path is not None and not resumable(path):
        raise CheckpointError(
            f"{path}: saved with save_only_model (the weights alone, without the optimizer, scheduler and "
            "RNG states a resume needs); resume from a checkpoint saved without it, or start a new run from "
            f"these weights (model_name_or_path: {path})"
        )
    return path


def resume_candidate(spec: str | bool | None, output_dir: str | Path) -> Path | None:
    """The checkpoint ``spec`` names (``auto``/True: the newest complete one), not yet verified:
    what a run plans with before its process group verifies it in ``find_resumable``."""
    if spec in (None, False, ""):
        return None
    path = (complete_checkpoints(output_dir) or [None])[-1] if spec in (True, "auto") else Path(spec)
    return refuse_model_only(path) if path is not None and is_complete(path) else None


def find_resumable(
    spec: str | bool | None, output_dir: str | Path, dist: DistInfo, snapshots: Path | None = None
) -> Path | None:
    """The checkpoint to resume from, verified on every rank before anything is loaded.

    ``auto``/True: the newest complete checkpoint (or flash snapshot, from ``snapshots``); if it
    fails verification (a rank cannot see it, a checksum differs), every rank warns and the previous
    one is tried. A path: that checkpoint, or one error naming the bad files.
    """
    if spec in (None, False, ""):
        return None
    if spec not in (True, "auto"):
        path = Path(spec)
        if not is_complete(path):
            raise CheckpointError(f"{path}: not a complete checkpoint (no {MARKER} marker or {MANIFEST})")
        problems = verify_on_all_ranks(path, dist)
        if problems:
            raise CheckpointError("; ".join(problems))
        return refuse_model_only(path)
    candidates = _candidates(output_dir, snapshots)
    if not candidates:
        if dist.is_main:
            print(f"No complete checkpoint in {output_dir}; starting from scratch.", flush=True)
        return None
    for i, path in enumerate(candidates):
        problems = verify_on_all_ranks(path, dist)
        if not problems:
            return refuse_model_only(path)
        for problem in problems:
            warn(problem)
        fallback = f"falling back to {candidates[i + 1]}" if i + 1 < len(candidates) else "no older one left"
        warn(f"{path}: failed verification; {fallback}")
    raise CheckpointError(
        f"{output_dir}: no complete checkpoint passes verification (tried {', '.join(p.name for p in candidates)}); "
        "remove the corrupt ones or set resume_from_checkpoint to null to start from scratch"
    )


def _candidates(output_dir: str | Path, snapshots: Path | None) -> list[Path]:
    """Complete checkpoints and snapshots, newest first (a disk checkpoint before a snapshot of its
    step): the union of what every rank sees, so that all walk the same list."""
    mine = complete_checkpoints(output_dir) + (complete_checkpoints(snapshots) if snapshots else [])
    seen = {path for part in all_gather_object([str(p) for p in mine]) for path in part}
    on_disk = Path(output_dir)
    return sorted(map(Path, seen), key=lambda p: (step_of(p) or 0, p.parent == on_disk), reverse=True)


def saved_batch(path: Path) -> tuple[int, int]:
    """(data-parallel size, global batch in samples) the checkpoint was written with."""
    manifest = read_manifest(path)
    world = manifest.get("data_parallel_size", manifest.get("world_size"))
    total = manifest.get("train_batch_size")
    if total is None and (path / "ds_config.json").is_file():
        total = json.loads((path / "ds_config.json").read_text()).get("train_batch_size")
    if not isinstance(world, int) or not isinstance(total, int):
        raise CheckpointError(f"{path / MANIFEST}: no world size or train_batch_size recorded")
    return world, total


def accumulation_for(path: Path, data_parallel: int, micro_batch: int) -> int | None:
    """Gradient accumulation steps that keep the checkpoint's global batch on ``data_parallel``
    ranks with micro-batches of ``micro_batch``; None when the data-parallel size is unchanged."""
    world, total = saved_batch(path)
    if world == data_parallel:
        return None
    if total % (micro_batch * data_parallel):
        raise CheckpointError(
            f"{path}: saved with a global batch of {total} samples on {world} ranks; {data_parallel} ranks × "
            f"per_device_train_batch_size {micro_batch} do not divide it. Choose a micro-batch that divides "
            f"{total}/{data_parallel}, or a world size that divides {total // micro_batch}"
        )
    return total // (micro_batch * data_parallel)


def needs_universal(path: Path, partitions: int) -> bool:
    """Optimizer states sharded over another number of ranks must go through the universal form.
    Unsharded ones (ZeRO-0 in fp32) load on any number of ranks as they are."""
    manifest = read_manifest(path)
    saved = manifest.get(
        "optimizer_partitions", manifest.get("data_parallel_size", manifest.get("world_size"))
    )
    return saved != partitions and any(_OPTIM_SHARD.match(name) for name in manifest["files"])


def _partitions(engine: Any, dist: DistInfo) -> int:
    """The ranks ZeRO shards the optimizer over: the data-parallel ones, and under sequence
    parallelism every rank (a group's ranks share rows, not optimizer shards)."""
    return getattr(engine, "partitions", getattr(engine, "world_size", dist.world_size))


def _convert_to_universal(source: Path, target: Path) -> None:
    """``deepspeed.checkpoint.ds_to_universal`` into a staging dir, committed like a checkpoint."""
    staging = target.with_name(STAGING + target.name)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    options = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(staging / DS_TAG),  # the tool writes latest_universal next to it
        num_extract_workers=1,  # in-process: no worker processes forked from a training rank
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    with (
        (staging / "conversion.log").open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        ds_to_universal.main(options)
    commit(staging, target, {"kind": "universal", "source": source.name})


def universal_copy(path: Path, dist: DistInfo) -> Path:
    """``path/universal``: converted once by rank 0 (reused while it verifies), then verified by all."""
    target = path / UNIVERSAL
    error = ""
    if dist.is_main and not (is_complete(target) and not verify(target)):
        print(f"{path}: converting to a universal checkpoint for {dist.world_size} ranks", flush=True)
        try:
            _convert_to_universal(path / DS_TAG, target)
        except Exception as err:  # any failure of the tool must reach every rank, not hang them
            error = f"{path / DS_TAG}: universal conversion failed ({type(err).__name__}: {err})"
    errors = [e for e in all_gather_object(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    problems = verify_on_all_ranks(target, dist)
    if problems:
        raise CheckpointError("; ".join(problems))
    return target


def load(engine: Any, path: Path, dist: DistInfo, restore_rng: bool = True) -> TrainerState:
    """Load a verified checkpoint into the engine; returns its TrainerState (as saved). A
    ``save_only_model`` checkpoint gives its weights alone (``load_best_model_at_end``), and
    refuses a resume (``restore_rng``)."""
    if not resumable(path):
        if restore_rng:
            refuse_model_only(path)
        engine.load_weights(load_file(str(path / WEIGHTS)))
        return TrainerState.load_from_json(path / "trainer_state.json")
    if needs_universal(path, _partitions(engine, dist)):
        engine.load_universal(str(universal_copy(path, dist)), DS_TAG)
    else:
        engine.load(str(path), DS_TAG, load_optimizer_states=True)
    if restore_rng:
        load_rng(path, dist.rank)
    return TrainerState.load_from_json(path / "trainer_state.json")
