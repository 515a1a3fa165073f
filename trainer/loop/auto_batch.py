"""HF's ``auto_find_batch_size``: a run whose first optimizer step runs out of memory trains again
from step 0 at half the per-device micro-batch, down to 1.

DeepSpeed fixes ``train_micro_batch_size_per_gpu`` when its engine is built, so a retry frees the
engine (``Engine.close``), plans the run again for the smaller micro-batch (``plan_run``: a new
DeepSpeed dict, step plan and data windows) and builds the engine and the sampler again. The model's
weights and the random generators are put back as they were when ``train`` started, and the failed
step's gradients dropped, so the run that retried trains as one started at the smaller micro-batch
would, step for step.

As HF's Trainer, the retry keeps ``gradient_accumulation_steps``: the global batch halves with the
micro-batch (the log line says so). Set the accumulation steps yourself to keep a global batch.

Only the run's first optimizer step is watched (``AutoBatchSize`` arms itself at step 0 and
disarms when that step ends): it allocates the activations, the gradients and the optimizer's
states, and nothing of it has been logged, evaluated or saved yet, so starting over loses nothing.
A resumed run is not watched. On more than one rank every rank must agree to start over, or one
would wait in a collective for a rank that left it: while armed, the objective is wrapped
(``VotedForward``) so that after each micro-batch's forward every rank says whether its forward ran
out of memory (one host all-reduce); any one makes every rank start over, before any backward (whose
gradient reduction is a collective). An out-of-memory error in the backward or the optimizer step
is retried on one rank only; on more it is raised. The forward must hold no collective for this, so
ZeRO-3 (which also partitions the model when it is built), tensor, pipeline and sequence
parallelism are refused with it (``check_auto_batch``, from ``plan_run``). The tiled loss runs its
forward outside the objective: with it, on more than one rank, an out-of-memory forward is raised.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from trainer.args import TrainingArguments
from trainer.checkpoint.layout import rng_state, set_rng_state
from trainer.config.errors import ConfigError
from trainer.engine import Engine
from trainer.observe.monitor import empty_device_cache
from trainer.runtime.distributed import host_all_reduce, print_main
from trainer.runtime.mesh import Mesh
from trainer.runtime.state import TrainerCallback

T = TypeVar("T")

# What torch raises where host memory runs out: a RuntimeError, not an OutOfMemoryError.
HOST_OOM = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(err: BaseException) -> bool:
    """An accelerator's out-of-memory error (``torch.OutOfMemoryError``, which
    ``torch.cuda.OutOfMemoryError`` is), or the host allocator's."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and HOST_OOM in str(err))


def check_auto_batch(args: TrainingArguments, ds_config: dict[str, Any], mesh: Mesh) -> None:
    """Refuse ``auto_find_batch_size`` where starting over cannot work, naming both settings."""
    if not args.auto_find_batch_size:
        return
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    conflicts = [
        (stage == 3, "zero_optimization.stage 3", "the model is partitioned when it is built, and is not built again"),
        (mesh.tensor > 1, f"tensor_parallel_size {mesh.tensor}", "the forward's collectives would wait on a rank out of memory"),
        (mesh.pipeline > 1, f"pipeline_parallel_size {mesh.pipeline}", "the stages' exchanges would wait on a rank out of memory"),
        (mesh.sequence > 1, f"sequence_parallel_size {mesh.sequence}", "the forward's collectives would wait on a rank out of memory"),
    ]  # fmt: skip
    for conflict, setting, why in conflicts:
        if conflict:
            raise ConfigError(
                [("auto_find_batch_size", f"cannot be used with {setting}: {why}; set "
                  "per_device_train_batch_size to a size that fits (`trainer plan` finds one)")]
            )  # fmt: skip


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class BatchTooLarge(Exception):
    """Raised on every rank alike when any rank's forward ran out of memory in the watched step."""

    def __init__(self, ranks: int, world: int, message: str):
        where = f"in the forward on {ranks} of {world} ranks" if world > 1 else "in the forward"
        super().__init__(f"{where}: {message}" if message else where)


class VotedForward:
    """The objective of the watched step: every micro-batch's forward is followed by one host
    all-reduce of "mine ran out of memory"; any one raises ``BatchTooLarge`` on every rank. The rest
    of the objective is the wrapped one's."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def loss_sum(self, tokens: Any, batch: Any, items: float) -> Any:
        message = ""
        try:
            result = self.inner.loss_sum(tokens, batch, items)
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            if not is_out_of_memory(err):
                raise
            message, result = first_line(err), None
        ranks, world = (int(n) for n in host_all_reduce([1.0 if message else 0.0, 1.0]))
        if ranks:
            raise BatchTooLarge(ranks, world, message)
        return result


class AutoBatchSize(TrainerCallback):
    """The retry: ``run`` trains and, where the watched first step ran out of memory, calls
    ``start_over(micro_batch, saved)`` (the Trainer frees its engine and plans again) with the state
    it saved before the first try, then trains again. As a callback it watches the run's first step:
    armed at ``on_step_begin`` of step 0, disarmed at its ``on_step_end``."""

    def __init__(self, args: TrainingArguments, model: torch.nn.Module, world_size: int):
        self.enabled = bool(args.auto_find_batch_size)
        self.model, self.world_size = model, world_size
        self.engine: Engine | None = None  # the armed engine
        self.weights: dict[str, torch.Tensor] | None = None

    def run(
        self, train: Callable[[], T], start_over: Callable[[int, Any], None], saved: Any, micro_batch: int
    ) -> T:
        """``train()``, tried again at half ``micro_batch`` after each out-of-memory first step;
        ``saved``: the Trainer's state before the first try, handed back (a copy) to ``start_over``."""
        if not self.enabled:
            return train()
        start, saved = rng_state(), copy.deepcopy(saved)
        try:
            while True:
                try:
                    return train()
                except Exception as err:
                    if not self._retried(err, micro_batch):
                        self._disarm()
                        raise
                    what = first_line(err)
                # Out of the except block: the failed step's frames (and their tensors) are gone.
                smaller = micro_batch // 2
                print_main(
                    f"auto_find_batch_size: out of memory at per_device_train_batch_size {micro_batch} "
                    f"({what}); training again from step 0 at per_device_train_batch_size {smaller} "
                    "(gradient_accumulation_steps kept: the global batch halves, as HF's)"
                )
                self._disarm()
                start_over(smaller, copy.deepcopy(saved))
                self.model.load_state_dict(self.weights)
                # A failed backward or optimizer step leaves its gradients on the parameters, which
                # the next engine's first backward would add to.
                self.model.zero_grad(set_to_none=True)
                set_rng_state(start)
                gc.collect()
                empty_device_cache()
                micro_batch = smaller
        finally:
            self.weights = None

    def _retried(self, err: Exception, micro_batch: int) -> bool:
        """Whether ``err`` starts the run over; at micro-batch 1 an out-of-memory error is raised."""
        voted = isinstance(err, BatchTooLarge)
        # On one rank nothing waits: any out-of-memory error of the watched step starts over.
        if self.engine is None or not (voted or (self.world_size == 1 and is_out_of_memory(err))):
            return False
        if micro_batch <= 1:
            self._disarm()
            raise torch.OutOfMemoryError(
                f"auto_find_batch_size: out of memory at per_device_train_batch_size 1, the smallest: {err}"
            ) from err
        return True

    def on_step_begin(self, args, state, control, engine=None, **kw):
        if self.enabled and state.global_step == 0 and engine is not None and self.engine is None:
            self.engine = engine
            engine.objective = VotedForward(engine.objective)
            # The weights before any step (on the host): an out-of-memory optimizer step may have
            # updated some of them before it failed.
            weights = self.model.state_dict().items()
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in weights}

    def on_step_end(self, args, state, control, **kw):
        self._disarm()
        self.weights = None  # the first step fitted: nothing will start over

    def _disarm(self) -> None:
        if self.engine is not None and isinstance(self.engine.objective, VotedForward):
            self.engine.objective = self.engine.objective.inner
        self.engine = None


def start_over(trainer: Any, micro_batch: int, saved: tuple[Any, Any]) -> None:
    """The retry's fresh start: the trainer's engine freed and its snapshots released (both built
    before the first step), its state and control as ``train`` found them, its arguments (and run
    config) copied with ``micro_batch``; ``train`` then plans the run again."""
    trainer.engine.close()
    trainer.checkpoints.release_snapshots()
    trainer.engine = trainer.checkpoints = trainer.plan = None
    trainer.state, trainer.control = saved
    trainer.args = trainer.args.model_copy(update={"per_device_train_batch_size": micro_batch})
    if trainer.run_config is not None:
        trainer.run_config = trainer.run_config.model_copy(update={"training": trainer.args})
