"""Checkpoint directories: the layout, and saving (``Saver``: staging, the ranks' vote, the atomic
commit, retention). The names, manifest, commit and rotation are ``trainer/checkpoint/layout.py``'s;
finding, verifying and loading a checkpoint to resume from (and the universal conversion for a new
world size) ``trainer/checkpoint/resume.py``'s; HF exports ``trainer/checkpoint/export.py``'s. The
package (``from trainer import checkpoint as ckpt``) exports what the rest of the trainer uses.

``output_dir/checkpoint-<step>/`` holds::

    ds/                     DeepSpeed's own state (model, optimizer and scheduler shards)
    trainer_state.json      TrainerState, including the data position
    rng_state_<rank>.pt     python/numpy/torch RNG states of each rank, and what its producer
                            keeps (an RL run's rollout buffer): tensors, numbers and lists only
    ds_config.json          the DeepSpeed config that wrote it
    run_config.yaml         the resolved run config
    manifest.json           size and checksum of every file above, plus the objective, world size,
                            parallel layout, ZeRO stage, batch, and the xxh3-128 of each local data
                            file the run reads
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

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.args import RunConfig, TrainingArguments
from trainer.args.recipe import dump_run_config
from trainer.checkpoint import disk
from trainer.checkpoint.layout import (
    DISK_FULL_BYTES,
    DS_TAG,
    WEIGHTS,
    CheckpointError,
    CheckpointWriteError,
    commit,
    complete_checkpoints,
    final_dir,
    read_manifest,
    remove_stale_staging,
    rng_state,
    rotate,
    staging_dir,
)
from trainer.checkpoint.writer import FileWriter, save_weights
from trainer.config.files import precision_of
from trainer.data.sources import content_digests
from trainer.runtime.distributed import DistInfo, all_gather_object, barrier, warn
from trainer.runtime.run_files import DS_CONFIG, RUN_CONFIG
from trainer.runtime.state import TrainerState

if TYPE_CHECKING:
    from trainer.engine import Engine


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
        # What a resume checks the data files against: their bytes, read once for the run.
        self.data_files = (
            content_digests(run_config.data) if run_config is not None and dist.is_main else None
        )

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def written(self) -> bool:
        """This rank's part of the pending save is on disk (or failed); local, no communication."""
        return self._pending is None or self._pending[0].done()

    def save(
        self,
        engine: Engine,
        state: TrainerState,
        on_written: Callable[[], None] | None = None,
        model_only: bool = False,
        rank_state: dict[str, Any] | None = None,
    ) -> Path | None:
        """Start ``checkpoint-<step>``; returns it once committed (synchronous saves), else None.
        ``on_written`` runs on each rank once its files are handed to the writer (fault injection).
        ``model_only`` (``save_only_model``): the weights alone, without DeepSpeed's optimizer and
        scheduler states or the RNG states. ``rank_state``: what this rank keeps beside its RNG
        states (a rollout buffer), in the same file."""
        self.finish()
        args, dist = self.args, self.dist
        staging, final = (
            staging_dir(args.output_dir, state.global_step),
            final_dir(args.output_dir, state.global_step),
        )
        self._expected = self._expected_size(engine)
        room = disk.free_bytes(args.output_dir) >= self._expected[0] if dist.is_main else True
        if not all(all_gather_object(room)):  # every rank learns rank 0's answer
            raise self._full_disk(final)
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
                writer.save({**rng_state(), **(rank_state or {})}, staging / f"rng_state_{dist.rank}.pt")
            if dist.is_main:
                writer.write_text(staging / "trainer_state.json", state.to_json())
                writer.write_text(staging / DS_CONFIG, json.dumps(self.ds_config, indent=2, sort_keys=True))
                if self.run_config is not None:
                    dump_run_config(self.run_config, staging / RUN_CONFIG)
                for item in self.hf_files:
                    item.save_pretrained(staging)
        except Exception as err:  # torch.save and tokenizers raise RuntimeError/Exception for OS errors
            warn(f"{staging}: could not write checkpoint ({err})")
            writer.failed = err
        if on_written is not None:
            on_written()
        meta = {
            "step": state.global_step,
            **engine.mesh.manifest_sizes(),
            "objective": args.objective,
            "zero_stage": self.ds_config.get("zero_optimization", {}).get("stage", 0),
            "train_batch_size": self.ds_config.get("train_batch_size"),
            "micro_batch_size": self.ds_config.get("train_micro_batch_size_per_gpu"),
            "gradient_accumulation_steps": self.ds_config.get("gradient_accumulation_steps"),
            "model_only": model_only,
            "data_files": self.data_files,
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
        if full:
            raise self._full_disk(final, "; its partial files were removed")
        raise CheckpointWriteError(f"{final.name} not saved: {failure}; its partial files were removed")

    def _expected_size(self, engine: Engine) -> tuple[int, str]:
        """Bytes the next checkpoint takes, and where that figure comes from."""
        done = complete_checkpoints(self.args.output_dir)
        if done:
            with contextlib.suppress(CheckpointError):
                files = read_manifest(done[-1])["files"].values()
                return sum(entry["size"] for entry in files), f"the size of {done[-1].name}"
        n_params = engine.parameter_counts()[1]
        estimate = disk.estimated_checkpoint_bytes(n_params, precision_of(self.ds_config))
        return estimate, "estimated: weights and optimizer states"

    def _full_disk(self, final: Path, removed: str = "") -> CheckpointWriteError:
        """The error of a save the disk had no room for, with its figures (``full_disk``)."""
        needed, source = self._expected
        free = disk.free_bytes(self.args.output_dir)
        line = disk.full_disk(needed, source, free)
        return CheckpointWriteError(
            f"{final.name} not saved: {line}{removed}", full_disk=(final.name, needed, free)
        )
