"""Fault injection for tests: a crash, a crash inside a save, or a non-finite loss, at a planned step.

``TRAINER_FAULT`` in the environment plans one fault, e.g. ``crash:rank=1:step=7``,
``crash:rank=1:step=8:phase=save`` (``phase=snapshot`` and ``phase=eval`` likewise) or
``nan:step=5`` (and ``hang:rank=1:phase=save``, which the hang watchdog acts on; and
``crash:rank=1:phase=worker:sample=20``, a streamed run's DataLoader worker killed as it reads the
rank's sample 20, which ``trainer.data.stream`` carries out). ``trainer train``
installs ``FaultInjection`` when it is set; tests that drive the Trainer themselves pass the
callback. Nothing here is part of the training loop.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.snapshots import snapshot_dir
from trainer.runtime.distributed import dist_info
from trainer.runtime.state import TrainerCallback


def fault_due(plan: dict[str, Any], kind: str, rank: int, step: int, phase: str | None = None) -> bool:
    """Whether a planned fault of this kind fires on this rank at this step (and in this phase:
    a plan without one fires after the step)."""
    return (plan.get("kind"), plan.get("rank"), plan.get("step"), plan.get("phase")) == (
        kind,
        rank,
        step,
        phase,
    )


def crash_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjection(TrainerCallback):
    """Carries out a fault plan through the engine the Trainer passes to callbacks: its declared
    ``objective`` and its ``after`` hooks (nothing of the engine is replaced).

    ``nan``: the engine's loss function returns NaN for one step (once per process, or a rollback
    would replay it forever). ``crash`` after a step: SIGKILL once the step ends. ``crash`` with
    ``phase=save``: SIGKILL inside that step's save, once this rank's DeepSpeed files are handed
    to the writer and before the ranks vote on the commit; ``phase=snapshot`` the same inside the
    step's flash snapshot (its files still being written in the background); ``phase=eval``: SIGKILL
    inside that step's evaluation, after this rank's first batch and before the ranks' loss gather."""

    def __init__(self, plan: dict[str, Any]):
        self.plan = dict(plan)
        self.rank = dist_info().rank
        self._objective: Any = None

    def on_step_begin(self, args, state, control, engine=None, **kw):
        if self.plan.get("kind") == "nan" and state.global_step + 1 == self.plan.get("step"):
            self.plan.pop("kind")
            self._objective = engine.objective
            engine.objective = NaNLoss(engine.objective)

    def on_step_end(self, args, state, control, engine=None, **kw):
        if self._objective is not None:
            engine.objective, self._objective = self._objective, None
        if fault_due(self.plan, "crash", self.rank, state.global_step):
            crash_now()
        snapshots = snapshot_dir(args.output_dir)
        if fault_due(self.plan, "crash", self.rank, state.global_step, phase="save"):
            engine.after("save", _crash_if(lambda path, *a, **k: snapshots not in Path(path).parents))
        if fault_due(self.plan, "crash", self.rank, state.global_step, phase="snapshot"):
            engine.after("save", _crash_if(lambda path, *a, **k: snapshots in Path(path).parents))
        if fault_due(self.plan, "crash", self.rank, state.global_step, phase="eval"):
            engine.after("eval_step", _crash_if(lambda *a, **k: True))


class NaNLoss:
    """An objective whose losses are NaN: the wrapped one's, times NaN (its counts unchanged)."""

    def __init__(self, objective: Any):
        self.objective = objective

    def __getattr__(self, name: str) -> Any:
        return getattr(self.objective, name)

    def loss_sum(self, *args: Any, **kwargs: Any) -> Any:
        loss, outputs = self.objective.loss_sum(*args, **kwargs)
        return loss * float("nan"), outputs


def _crash_if(due: Callable[..., bool]) -> Callable[..., None]:
    """An engine hook (``Engine.after``): SIGKILL after the first call that ``due`` picks out."""

    def crash(*a: Any, **k: Any) -> None:
        if due(*a, **k):
            crash_now()

    return crash
