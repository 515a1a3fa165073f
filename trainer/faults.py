"""Fault injection for tests: ``TRAINER_FAULT`` plans a crash, a hang or a non-finite loss at a
given rank, step and phase, so the recovery paths run for real in end-to-end tests.

A plan is a plain dict, so the hang watchdog (``trainer.resilience.Watchdog``) takes it as its
``faults`` without importing this module.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def fault_plan() -> dict[str, Any]:
    """``TRAINER_FAULT`` for tests, e.g. ``crash:rank=1:step=7``, ``hang:rank=1:phase=save``,
    ``nan:step=5``. Crashes fire only in the first attempt of an elastic agent, so a restarted
    job gets past them."""
    spec = os.environ.get("TRAINER_FAULT", "")
    if not spec:
        return {}
    kind, *fields = spec.split(":")
    plan: dict[str, Any] = {"kind": kind}
    for field in fields:
        name, _, value = field.partition("=")
        plan[name] = int(value) if value.lstrip("-").isdigit() else value
    if kind == "hang":
        plan["hang"] = plan.pop("phase")
    if kind == "crash" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return {}
    return plan


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
    """SIGKILL, not an exception: nothing gets to flush or clean up, as after an OOM kill or a lost
    node, which is what the recovery paths must survive."""
    os.kill(os.getpid(), signal.SIGKILL)
