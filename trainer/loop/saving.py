"""The loop's saves: checkpoints (synchronous or asynchronous) and flash snapshots.

An asynchronous checkpoint and a snapshot are committed at a later step's vote, once every rank
has written its part: while either is in flight, ``Checkpoints`` is a participant of the step's vote
(``trainer.loop.vote``); with none in flight, a step runs none of this module.
A checkpoint that cannot be written follows ``save_failure_policy``; a snapshot that cannot is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer.checkpoint.export import export_hf
from trainer.checkpoint.snapshots import Snapshots
from trainer.data import ResumableDistributedSampler
from trainer.data.loader import data_seed
from trainer.data.stream import StreamPosition
from trainer.loop.vote import Participant
from trainer.model.modeling import is_adapter
from trainer.runtime.distributed import all_gather_object, barrier, dist_info
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
        #: The run's producer: what it keeps of this rank goes beside the RNG states of every
        #: checkpoint and snapshot (it holds no reference to the Trainer: no cycle).
        self.producer: Any = None
        self.in_flight: list[Participant] = []  # in the step's vote: [self] while anything is in flight

    @property
    def pending(self) -> bool:
        return self.saver is not None and self.saver.pending

    def ballot(self) -> list[float]:
        """This rank's "my files are written": of the asynchronous save in flight, then of the
        snapshot in flight (each only while it is)."""
        mine = [float(self.saver.written())] if self.pending else []
        return mine + (self.snapshots.ballot() if self.snapshots is not None else [])

    def tally(self, totals: list[float]) -> None:
        if self.pending:
            self._committed(lambda: self.saver.commit_if_written(totals[0]))
            totals = totals[1:]
        if self.snapshots is not None:
            self.snapshots.tally(totals)
        self._refresh()

    def _refresh(self) -> None:
        """Whether the next step's vote needs this saver: a save or a snapshot is in flight."""
        in_flight = self.pending or (self.snapshots is not None and self.snapshots.pending)
        self.in_flight = [self] if in_flight else []

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
        kept = self._rank_state()
        self._committed(lambda: self.saver.save(engine, state, model_only=model_only, rank_state=kept))
        self._refresh()

    def finish(self) -> None:
        """Commit the pending asynchronous save now, waiting for its writes; none pending, a no-op."""
        if self.saver is not None:
            self._committed(self.saver.finish)
        self._refresh()

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

    def settle_snapshot(self) -> None:
        """Commit the snapshot in flight (before the next one, a checkpoint save or an evaluation)."""
        if self.snapshots is not None:
            self.snapshots.settle()
        self._refresh()

    def take_snapshot(self, engine: Any, state: TrainerState) -> None:
        """A snapshot of this step (due every ``snapshot_steps`` steps)."""
        self._stamp(state)
        self.snapshots.take(engine, state, self._rank_state())
        self._refresh()

    def _rank_state(self) -> dict[str, Any]:
        return {"producer": self.producer.state_dict()} if self.producer is not None else {}

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
        self._refresh()


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


def export_model(trainer: Any, target: Path) -> Path:
    """``save_model``: the trainer's current weights as an HF model directory (config, safetensors,
    tokenizer, ``training_args.bin`` as HF's), gathered under ZeRO-3; a LoRA run's adapter alone."""
    model, engine = trainer.model, trainer.engine
    adapter = is_adapter(model)  # a LoRA run exports its adapter: the weights that train
    if engine:
        state_dict = engine.full_state_dict(trainable_only=adapter)
    else:
        trained = {k: p for k, p in model.named_parameters() if p.requires_grad}
        state_dict = trained if adapter else model.state_dict()
    if trainer.dist.is_main:
        export_hf(engine.module if engine else model, state_dict, trainer.processing_class, target)
        torch.save(trainer.args, target / "training_args.bin")
    barrier("save_model")
    return target
