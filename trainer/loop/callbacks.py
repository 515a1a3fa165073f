"""Callbacks in the HF style: they read ``TrainerState`` and set ``TrainerControl`` flags (both, and
``TrainerCallback``, live in ``trainer.runtime.state`` and are importable from here as in HF).

A callback never steps the optimizer or calls backward.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from tqdm.auto import tqdm

from trainer.args import TrainingArguments
from trainer.model.neftune import NEFTune
from trainer.observe.metrics import MetricsWriter
from trainer.observe.monitor import EmptyDeviceCache
from trainer.observe.reporting import reporting_callbacks
from trainer.runtime.mesh import Mesh
from trainer.runtime.state import CONTROL_FLAGS, TrainerCallback, TrainerControl, TrainerState

logger = logging.getLogger(__name__)


class CallbackHandler:
    def __init__(self, callbacks: list[TrainerCallback]):
        self.callbacks = list(callbacks)

    def add(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """Append a callback; a class is instantiated. A second one of a class is allowed, with a
        warning, as HF's handler does (two progress bars or metric writers are rarely meant)."""
        instance = callback() if isinstance(callback, type) else callback
        if any(type(cb) is type(instance) for cb in self.callbacks):
            logger.warning("a second %s was added to the Trainer's callbacks", type(instance).__name__)
        self.callbacks.append(instance)

    def pop(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """Remove and return the callback: the first instance of a class, or the instance itself
        (compared with ``==``); None when there is none, as HF's ``pop_callback``."""
        for cb in self.callbacks:
            found = isinstance(cb, callback) if isinstance(callback, type) else cb == callback
            if found:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """As HF's ``remove_callback``: a class removes its first instance (none is no error); an
        instance that is not there raises ``ValueError``, as removing it from a list does."""
        if isinstance(callback, type):
            self.pop(callback)
        else:
            self.callbacks.remove(callback)

    def fire(self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw):
        """Run ``event`` on every callback, as HF's handler does: a callback may change the control it
        is given, return it, return None, or return another control (transformers' own class too,
        whose flags are taken over)."""
        base = getattr(TrainerCallback, event, None)
        for cb in self.callbacks:
            method = getattr(cb, event)
            if getattr(method, "__func__", None) is base:  # the base class's no-op
                continue
            result = method(args, state, control, **kw)
            if isinstance(result, TrainerControl):
                control = result
            elif result is not None and all(hasattr(result, flag) for flag in CONTROL_FLAGS):
                for flag in CONTROL_FLAGS:
                    setattr(control, flag, bool(getattr(result, flag)))
        return control


def default_callbacks(args: TrainingArguments, mesh: Mesh) -> list[TrainerCallback]:
    """The Trainer's own callbacks, before the user's: the flow, ``metrics.jsonl``, the progress bar,
    transformers' own for ``report_to``, NEFTune's noise and emptying the device cache, when asked for."""
    default = [DefaultFlowCallback(), MetricsCallback(), ProgressCallback(), *reporting_callbacks(args)]
    if args.neftune_noise_alpha is not None:
        default.append(NEFTune(args, mesh))
    if args.torch_empty_cache_steps is not None:
        default.append(EmptyDeviceCache(args.torch_empty_cache_steps))
    return default


class DefaultFlowCallback(TrainerCallback):
    """Turns the step/epoch strategies of the arguments into log/eval/save/stop decisions."""

    def on_train_begin(self, args, state, control, **kw):
        # The intervals HF's Trainer records in its state before on_train_begin (wandb reads them).
        state.logging_steps = args.logging_steps
        state.eval_steps = args.eval_steps or args.logging_steps
        state.save_steps = args.save_steps
        state.train_batch_size = args.per_device_train_batch_size

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step
        every = args.logging_strategy == "steps" and step % args.logging_steps == 0
        control.should_log = every or (args.logging_first_step and step == 1) or step == state.max_steps
        eval_every = args.eval_steps or args.logging_steps
        eval_due = args.eval_strategy == "steps" and step % eval_every == 0
        control.should_evaluate = eval_due and args.eval_delay <= step  # HF's: no evaluation before it
        control.should_save = args.save_strategy == "steps" and step % args.save_steps == 0
        if step >= state.max_steps:
            control.should_training_stop = True
            control.should_save = control.should_save or args.save_strategy != "no"
        return control

    def on_epoch_end(self, args, state, control, **kw):
        control.should_log = control.should_log or args.logging_strategy == "epoch"
        eval_due = args.eval_strategy == "epoch" and args.eval_delay <= state.epoch
        control.should_evaluate = control.should_evaluate or eval_due
        control.should_save = control.should_save or args.save_strategy == "epoch"
        return control


class FinalEvaluationCallback(TrainerCallback):
    """The command line's evaluation of the trained model, at the last step inside training: its
    row is logged there, so the run summary's best eval loss and a checkpoint saved at that step see it."""

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= state.max_steps or control.should_training_stop:
            control.should_evaluate = True
        return control


class ProgressCallback(TrainerCallback):
    """A tqdm bar on the main rank with the ETA and the latest loss."""

    def __init__(self) -> None:
        self.bar = None

    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero and not args.disable_tqdm:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kw):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kw):
        if self.bar is not None and logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs.get('learning_rate', 0):.2e}")

    def on_train_end(self, args, state, control, **kw):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class MetricsCallback(TrainerCallback):
    """Writes every log row to ``metrics.jsonl`` on the main rank, with its step (``report_to``'s
    integrations are transformers' own callbacks: trainer/observe/reporting.py). Rows logged outside
    ``train()`` (an ``evaluate()`` or ``Trainer.log`` after it) are written too, so the file holds
    every row of ``state.log_history``."""

    def __init__(self) -> None:
        self.writer = None

    def on_train_begin(self, args, state, control, **kw):
        if self.writer is None:
            self.writer = MetricsWriter(args.output_dir, is_main=state.is_world_process_zero)

    def on_log(self, args, state, control, logs=None, **kw):
        if not logs:
            return
        if self.writer is None:
            self.writer = MetricsWriter(args.output_dir, is_main=state.is_world_process_zero)
        # As HF's, the logs callbacks get carry no step; the row records the state's.
        self.writer.write({"step": state.global_step, **logs})

    def on_train_end(self, args, state, control, **kw):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class EarlyStoppingCallback(TrainerCallback):
    """Stop when the eval metric has not improved by ``threshold`` for ``patience`` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.patience = early_stopping_patience
        self.threshold = early_stopping_threshold
        self.best: float | None = None
        self.bad_evals = 0

    def state(self) -> dict[str, Any]:
        """HF's ``ExportableState``: what a resume with restore_callback_states_from_checkpoint rebuilds."""
        args = {"early_stopping_patience": self.patience, "early_stopping_threshold": self.threshold}
        return {"args": args, "attributes": {"best": self.best, "bad_evals": self.bad_evals}}

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        key = metric_key(args)
        value = (metrics or {}).get(key)
        if value is None or not math.isfinite(value):
            return control
        sign = 1 if greater_is_better(args) else -1
        if self.best is None or sign * (value - self.best) > self.threshold:
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
            if self.bad_evals >= self.patience:
                control.should_training_stop = True
        return control


def _exportable(callback: Any) -> bool:
    """HF's test for a callback whose state a checkpoint keeps: transformers' ``ExportableState``."""
    from transformers.trainer_callback import ExportableState  # loaded with the Trainer already

    return isinstance(callback, ExportableState | TrainerControl | EarlyStoppingCallback)


def callback_states(callbacks: list[Any], control: TrainerControl) -> dict[str, Any]:
    """``TrainerState.stateful_callbacks`` as HF's Trainer writes it: each stateful callback's (and
    the control's) ``state()`` by class name, a list where several share a class."""
    states: dict[str, list[Any]] = {}
    for callback in [*callbacks, control]:
        if _exportable(callback):
            states.setdefault(type(callback).__name__, []).append(callback.state())
    return {name: found[0] if len(found) == 1 else found for name, found in states.items()}


def restore_callback_states(
    handler: CallbackHandler, stored: dict[str, Any], control: TrainerControl
) -> TrainerControl:
    """HF's ``restore_callback_states_from_checkpoint``: each saved state replaces the callback of its
    class passed to the Trainer (rebuilt from the saved arguments, then given the saved attributes),
    and the control; returns the control. States of classes not passed in are ignored, with a warning."""
    not_found = []
    for name, saved in stored.items():
        passed = [cb for cb in [*handler.callbacks, control] if type(cb).__name__ == name]
        if not passed:
            not_found.append(name)
        for old, state in zip(passed, saved if isinstance(saved, list) else [saved], strict=False):
            new = type(old)(**state.get("args", {}))
            for attribute, value in state.get("attributes", {}).items():
                setattr(new, attribute, value)
            if old is control:
                control = new
            else:
                handler.callbacks[handler.callbacks.index(old)] = new
    if not_found:
        logger.warning("The checkpoint holds states of callbacks this Trainer was not given: %s", not_found)
    return control


def metric_key(args: TrainingArguments) -> str:
    name = args.metric_for_best_model or "loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def greater_is_better(args: TrainingArguments) -> bool:
    if args.greater_is_better is not None:
        return args.greater_is_better
    return not metric_key(args).endswith("loss")


def update_best_metric(state: TrainerState, args: TrainingArguments) -> None:
    """After each evaluation of the loop, as HF's: the best metric and its step; a checkpoint saved
    at that step is the best checkpoint."""
    key = metric_key(args)
    latest = next((row[key] for row in reversed(state.log_history) if key in row), None)
    if latest is None:
        return
    sign = 1 if greater_is_better(args) else -1
    if state.best_metric is None or sign * (latest - state.best_metric) > 0:
        state.best_metric = latest
        state.best_global_step = state.global_step
