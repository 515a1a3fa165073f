"""Resuming from a checkpoint (collective calls): what a resume continues and may change, finding
the newest checkpoint (or flash snapshot) that verifies on every rank, the global batch kept on
another world size, the universal conversion when the optimizer's shards no longer fit, and the load.

Before anything is loaded, every rank checksums its share of the files against the manifest:
DeepSpeed unpickles its shards with ``torch.load(weights_only=False)``, so only verified bytes may
reach it. DeepSpeed's shards are the engine's (``Engine.load``, ``Engine.load_universal``); the
conversion is ``trainer.engine.zero.convert_to_universal``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from safetensors.torch import load_file

from trainer.args import DataArguments, ModelArguments, RunConfig, TrainingArguments
from trainer.checkpoint.layout import (
    _OPTIM_SHARD,
    DS_TAG,
    MANIFEST,
    MARKER,
    STAGING,
    UNIVERSAL,
    WEIGHTS,
    CheckpointError,
    commit,
    complete_checkpoints,
    is_complete,
    load_rng,
    read_manifest,
    step_of,
    verify,
    verify_on_all_ranks,
)
from trainer.data.sources import content_digests
from trainer.runtime.distributed import DistInfo, all_gather_object, warn
from trainer.runtime.mesh import Mesh, saved_mesh
from trainer.runtime.run_files import DS_CONFIG, RUN_CONFIG
from trainer.runtime.state import TrainerState

if TYPE_CHECKING:
    from trainer.engine import Engine

# ---- what a resume continues -----------------------------------------------------------------

# Data fields that change neither the model nor the training data: evaluation size and caching.
_SAFE_DATA_FIELDS = {"max_eval_samples", "preprocessing_num_workers", "cache_dir"}


def run_config_changes(checkpoint: Path, run: RunConfig) -> tuple[list[str], list[str]]:
    """How ``run`` differs from the run that wrote ``checkpoint``: (fields of the model, tokenizer
    or training data, and data files rewritten in place, which a resume must refuse; other fields,
    which it may take on).
    Nothing is compared when the checkpoint holds no run config (written through the Trainer API);
    a field the saved config lacks (one added since it was written) counts as its default there."""
    if not (checkpoint / RUN_CONFIG).is_file():
        return [], []
    saved, current = _saved_run(checkpoint), run.to_flat()
    defaults = {
        name: spec.default
        for model in (TrainingArguments, ModelArguments, DataArguments)
        for name, spec in model.model_fields.items()
    }
    changed = sorted(
        k for k in saved.keys() | current.keys() if saved.get(k, defaults.get(k)) != current.get(k)
    )
    guarded = (set(ModelArguments.model_fields) | set(DataArguments.model_fields)) - _SAFE_DATA_FIELDS
    refused = [k for k in changed if k in guarded] + _rewritten_data(checkpoint, run, changed)
    return refused, [k for k in changed if k not in guarded]


def _rewritten_data(checkpoint: Path, run: RunConfig, changed: list[str]) -> list[str]:
    """The data arguments whose files, at the same names, no longer hold the bytes the run that wrote
    ``checkpoint`` read (a file added to or gone from a directory counts), each with its files.
    A checkpoint that recorded no digests (older, or with no manifest) is not compared."""
    has_manifest = (checkpoint / MANIFEST).is_file()
    recorded = (read_manifest(checkpoint).get("data_files") or {}) if has_manifest else {}
    current = content_digests(run.data) if recorded else {}
    rewritten = []
    for key, files in sorted(recorded.items()):
        now = current.get(key, {})
        paths = sorted(p for p in files.keys() | now.keys() if files.get(p) != now.get(p))
        if paths and key not in changed:  # a changed argument is named already
            rewritten.append(f"{key} (the content of {', '.join(paths)})")
    return rewritten


def uncarried(checkpoint: Path, objective: str, zero_stage: int, layout: Any) -> tuple[str, str] | None:
    """The first of this run's objective, ZeRO stage and parallel layout that ``checkpoint`` cannot
    carry, as (the setting, one line saying why and what to do); None when it can resume. Read from
    its manifest (the objective, in checkpoints written before the manifest held it, from its run
    config; a checkpoint with neither is not compared). What carries, as measured: ZeRO 1 <-> 2 (same
    world size: the shards load as they are; another: the universal path), and a tensor-parallel size
    change of a ZeRO 1-2 checkpoint (the universal conversion re-splits it). What does not: DeepSpeed
    loads a ZeRO-0 or ZeRO-3 checkpoint only at its own stage, and a checkpoint only on its own pipeline
    stages; an expert-parallel checkpoint is resumed at its own expert-parallel size. ``layout``: this
    run's parallel sizes (its ``Mesh``, or the ``Sizes`` it is built from)."""
    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError:
        return None  # the resume's verification names it
    stage, saved = manifest.get("zero_stage", 0), saved_mesh(manifest)
    tensor, pipeline, expert = saved.tensor, saved.pipeline, saved.expert
    tensor_parallel, pipeline_parallel, expert_parallel = layout.tensor, layout.pipeline, layout.expert
    saved_objective = manifest.get("objective", _saved_run(checkpoint).get("objective"))
    rules = (
        ("objective", saved_objective, objective, saved_objective in (None, objective),
         "another objective is another run"),
        ("zero_stage", stage, zero_stage, stage == zero_stage or {stage, zero_stage} <= {1, 2},
         "ZeRO 1 and 2 resume each other's checkpoints, ZeRO 0 and 3 only their own"),
        ("tensor_parallel_size", tensor, tensor_parallel, tensor == tensor_parallel or stage in (1, 2),
         f"DeepSpeed's universal conversion re-splits the weights of ZeRO 1-2 checkpoints only, not ZeRO-{stage}"),
        ("pipeline_parallel_size", pipeline, pipeline_parallel,
         pipeline == pipeline_parallel, "a checkpoint is cut by its pipeline stages, and nothing re-cuts it"),
        ("expert_parallel_size", expert, expert_parallel, expert == expert_parallel,
         "its experts are saved by the ranks that held them, and the resume does not re-split them"),
    )  # fmt: skip
    for key, saved, now, carried, why in rules:
        if not carried:
            return key, (
                f"{checkpoint} was saved with {key} {saved} and this run asks for {now}; {why}: resume "
                f"with {key} {saved}, or use a new --output_dir, or --resume_from_checkpoint false to start over"
            )
    return None


def _saved_run(checkpoint: Path) -> dict:
    """The flat run config saved in ``checkpoint`` ({} without one)."""
    saved_file = checkpoint / RUN_CONFIG
    return (yaml.safe_load(saved_file.read_text()) or {}) if saved_file.is_file() else {}


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


# ---- which checkpoint ---------------------------------------------------------------------------


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
    world = saved_mesh(manifest).data_parallel_size
    total = manifest.get("train_batch_size")
    if total is None and (path / DS_CONFIG).is_file():
        total = json.loads((path / DS_CONFIG).read_text()).get("train_batch_size")
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


def needs_universal(path: Path, mesh: Mesh) -> bool:
    """Optimizer states sharded over another number of ranks, or weights split over another
    tensor-parallel size, must go through the universal form. Unsharded ones (ZeRO-0 in fp32, no
    tensor parallelism) load on any number of ranks as they are."""
    manifest = read_manifest(path)
    saved = saved_mesh(manifest)
    if saved.tensor != mesh.tensor:
        return True
    return saved.zero_shards != mesh.zero_shards and any(
        _OPTIM_SHARD.match(name) for name in manifest["files"]
    )


def refuse_unconvertible(path: Path) -> None:
    """DeepSpeed 0.19's universal conversion joins tensor-parallel slices of ZeRO 1-2 checkpoints
    only (ZeRO-3's fails inside the tool, ZeRO-0 has no shards it reads): any other TP checkpoint is
    refused here, by name, before the tool starts."""
    manifest = read_manifest(path)
    tp, stage = saved_mesh(manifest).tensor, manifest.get("zero_stage", 0)
    if tp > 1 and stage not in (1, 2):
        raise CheckpointError(
            f"{path}: ZeRO-{stage} with tensor_parallel_size {tp}: DeepSpeed's universal conversion joins "
            "tensor-parallel slices of ZeRO 1-2 checkpoints only; resume it with the same "
            "tensor_parallel_size and world size, and take the whole model from the run's final/"
        )


def _convert_to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's universal conversion (``trainer.engine.zero``) into a staging dir, committed like
    a checkpoint."""
    from trainer.engine.zero import convert_to_universal  # DeepSpeed loads only when converting

    staging = target.with_name(STAGING + target.name)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with (
        (staging / "conversion.log").open("w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        convert_to_universal(source, staging / DS_TAG)  # the tool writes latest_universal next to it
    commit(staging, target, {"kind": "universal", "source": source.name})


def universal_copy(path: Path, dist: DistInfo) -> Path:
    """``path/universal``: converted once by rank 0 (reused while it verifies), then verified by all."""
    target = path / UNIVERSAL
    refuse_unconvertible(path)  # the same on every rank: each raises alike
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


def load(
    engine: Engine, path: Path, dist: DistInfo, restore_rng: bool = True
) -> tuple[TrainerState, dict[str, Any]]:
    """Load a verified checkpoint into the engine; returns its TrainerState (as saved) and what
    this rank kept beside its RNG states (``Saver.save``'s ``rank_state``; {} with none). A
    ``save_only_model`` checkpoint gives its weights alone (``load_best_model_at_end``), and
    refuses a resume (``restore_rng``)."""
    if not resumable(path):
        if restore_rng:
            refuse_model_only(path)
        engine.load_weights(load_file(str(path / WEIGHTS)))
        return TrainerState.load_from_json(path / "trainer_state.json"), {}
    if needs_universal(path, engine.mesh):
        engine.load_universal(str(universal_copy(path, dist)), DS_TAG)
    else:
        engine.load(str(path), DS_TAG, load_optimizer_states=True)
    kept = load_rng(path, dist.rank) if restore_rng else {}
    return TrainerState.load_from_json(path / "trainer_state.json"), kept
