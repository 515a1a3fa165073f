"""The loop's saves: checkpoints (synchronous or asynchronous) and flash snapshots.

An asynchronous checkpoint and a snapshot are committed at a later step's vote, once every rank
has written its part (``Checkpoints`` and ``Snapshots`` are participants of ``trainer.loop.vote``).
A checkpoint that cannot be written follows ``save_failure_policy``; a snapshot that cannot is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import checkpoint as ckpt
from trainer.checkpoint.snapshots import Snapshots
from trainer.data import ResumableDistributedSampler
from trainer.data.loader import data_seed
from trainer.data.stream import StreamPosition
from trainer.loop.vote import Participant
from trainer.runtime.distributed import all_gather_object, dist_info
from trainer.runtime.full_disk import note_full_disk
from trainer.runtime.resilience import save_failed
from trainer.runtime.state import TrainerState


class Checkpoints:
    """The run's checkpoint saver and snapshots (every call collective). ``on_save`` is called with
    each checkpoint once it is committed: at once for a synchronous save, at a later step's vote
    (or ``finish``) for an asynchronous one."""

    def __init__(self, args: Any, saver_args: tuple[Any, ...], on_save: Callable[[Path], None]):
        self.args, self.saver_args, self.on_save = args, saver_args, on_save
        self.saver: ckpt.Saver | None = None
        self.snapshots: Snapshots | None = None
        self.saved: tuple[int, bool] | None = None  # (step, weights alone) of the last save
        self.data: Any = None  # the run's sampler; a stream's position goes into every checkpoint

    @property
    def participants(self) -> list[Participant]:
        """This step's vote: the checkpoint in flight, then the snapshot in flight."""
        return [self] if self.snapshots is None else [self, self.snapshots]

    @property
    def pending(self) -> bool:
        return self.saver is not None and self.saver.pending

    def ballot(self) -> list[float]:
        """While an asynchronous save is in flight: this rank's "my files are written"."""
        return [float(self.saver.written())] if self.pending else []

    def tally(self, totals: list[float]) -> None:
        if totals:
            self._committed(lambda: self.saver.commit_if_written(totals[0]))

    def save(
        self,
        engine: Any,
        state: TrainerState,
        stateful: Callable[[], dict[str, Any]],
        resumable: bool = False,
    ) -> None:
        """Start a checkpoint of this step. With save_only_model it holds the weights alone, unless it
        must be ``resumable`` (preemption). ``stateful``: the callbacks' states it keeps."""
        final = ckpt.final_dir(self.args.output_dir, state.global_step)
        model_only = self.args.save_only_model and not resumable
        saved = self.saved
        if saved is not None and saved[0] == state.global_step and (model_only or not saved[1]):
            return  # saved already in this run (an epoch-end save on a save_steps multiple)
        if state.best_global_step == state.global_step:
            state.best_model_checkpoint = str(final)
        if self.saver is None:
            self.saver = ckpt.Saver(*self.saver_args)
        self.saved = (state.global_step, model_only)
        self._stamp(state)
        state.stateful_callbacks = stateful()
        self._committed(lambda: self.saver.save(engine, state, model_only=model_only))

    def finish(self) -> None:
        """Commit the pending asynchronous save now, waiting for its writes; none pending, a no-op."""
        if self.saver is not None:
            self._committed(self.saver.finish)

    def _committed(self, save: Callable[[], Path | None]) -> None:
        """One step of saving; ``on_save`` once a checkpoint is committed. A checkpoint that cannot
        be written (its partial files are gone by now) follows save_failure_policy."""
        try:
            checkpoint = save()
        except ckpt.CheckpointWriteError as err:
            if err.full_disk is not None and self.args.save_failure_policy == "stop" and dist_info().is_main:
                note_full_disk(self.args.output_dir, *err.full_disk)  # the rerun's door reads it
            return save_failed(err, self.args.save_failure_policy)
        if checkpoint is not None:
            self.on_save(checkpoint)

    # ---- snapshots (--snapshot_steps) ----------------------------------------------------------

    def start_snapshots(self) -> None:
        """Training begins: snapshots every ``snapshot_steps`` steps, if asked for."""
        if self.args.snapshot_steps:
            self.snapshots = Snapshots(*self.saver_args)

    def snapshot_due(self, step: int) -> bool:
        return self.snapshots is not None and self.snapshots.due(step)

    def settle_snapshot(self) -> None:
        """Commit the snapshot in flight (before the next one, a checkpoint save or an evaluation)."""
        if self.snapshots is not None:
            self.snapshots.settle()

    def take_snapshot(self, engine: Any, state: TrainerState) -> None:
        self._stamp(state)
        self.snapshots.take(engine, state)

    def _stamp(self, state: TrainerState) -> None:
        """A stream's position at this step: every rank's lanes, gathered (every rank saves)."""
        if isinstance(self.data, StreamPosition):
            parts = all_gather_object(self.data.position(state.samples_into_epoch))
            lanes = {lane: cursor for part in parts for lane, cursor in part["lanes"].items()}
            state.data_position = {"lanes": lanes, "fingerprint": parts[0]["fingerprint"]}

    def release_snapshots(self) -> None:
        """Training ended: the last snapshot is committed and the directory removed."""
        if self.snapshots is not None:
            self.snapshots.release()
            self.snapshots = None


def resumed_state(
    saved: TrainerState, current: TrainerState, num_samples: int, data_ranks: tuple[int, int], args: Any
) -> TrainerState:
    """The run's state from a loaded checkpoint: where the run is comes from the checkpoint (its
    position in the epoch re-divided among this run's data ranks); how long it runs from ``current``."""
    if saved.world_size != data_ranks[0]:
        # The samples all ranks consumed, re-divided among this run's ranks.
        sampler = ResumableDistributedSampler(num_samples, *data_ranks, seed=data_seed(args))
        sampler.load_state_dict(
            {"epoch": saved.epoch_index, "start": saved.samples_into_epoch, "seed": data_seed(args),
             "num_replicas": saved.world_size}
        )  # fmt: skip
        saved.samples_into_epoch = sampler.start
    for plan in (
        "is_world_process_zero",
        "is_local_process_zero",
        "world_size",
        "max_steps",
        "num_train_epochs",
        "steps_per_epoch",
    ):
        setattr(saved, plan, getattr(current, plan))
    return saved
