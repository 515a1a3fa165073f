"""The run's state and the callback interface, in HF's names: ``TrainerState`` (saved as JSON in every
checkpoint, so a resumed run knows its step, epoch, data position, log history and best metric),
``TrainerControl`` (the flags callbacks set) and ``TrainerCallback`` (the hooks the loop calls).

They sit low so that checkpointing, monitoring and fault injection use them without importing the
loop; ``trainer.loop.callbacks`` holds the handler and the callbacks themselves.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.args import TrainingArguments


@dataclass
class TrainerState:
    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    steps_per_epoch: int = 0
    # Samples of the current epoch already consumed by this rank: the sampler resumes from here.
    epoch_index: int = 0
    samples_into_epoch: int = 0
    # A stream's position at the checkpoint: every lane's cursor (trainer.data.stream), None otherwise.
    data_position: dict[str, Any] | None = None
    # A stream's blocks trained of each source, summed over the data-parallel ranks: the realised mixture.
    source_blocks: dict[str, float] = field(default_factory=dict)
    num_input_tokens_seen: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    # Non-finite guard: learning-rate scale after rollbacks, and how often it fired.
    lr_scale: float = 1.0
    rollbacks: int = 0
    nonfinite_windows: int = 0
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_world_process_zero: bool = True
    world_size: int = 1  # data-parallel ranks (a sequence-parallel group counts once)
    # HF's TrainerState fields that transformers' callbacks (reporting, early stopping) read.
    is_local_process_zero: bool = True
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    total_flos: float = 0.0
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    # HF's: the states of stateful callbacks (and the control) at the checkpoint, by class name.
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    def save_to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def state(self) -> dict[str, Any]:
        """HF's ``ExportableState``: the flags, saved with every checkpoint."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


CONTROL_FLAGS = tuple(f.name for f in dataclasses.fields(TrainerControl))


class TrainerCallback:
    """Override any event. Each gets ``(args, state, control, **kwargs)`` and may return a control."""

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw): ...
