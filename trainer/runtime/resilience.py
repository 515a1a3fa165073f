"""What a run does when something goes wrong, and how it ends: the preemption flag, the hang
watchdog (its exit codes are in ``trainer.runtime.ranks``, where the door reads them without torch).

Kept apart from ``trainer.runtime.distributed`` so that module stays about joining and using the process
group. This one builds on it (rank facts, named barriers) and never the other way round.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.runtime.distributed import barrier, dist_info, print_main
from trainer.runtime.ranks import EXIT_HANG, EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_SAVE_FAILED  # noqa: F401  (re-exported)

# ---- planned faults (tests) ----------------------------------------------------------------------


def fault_plan() -> dict[str, Any]:
    """The planned fault as a dict (empty when none). Crashes fire only in the first attempt of an
    elastic agent, so a restarted job gets past them."""
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


def worker_crash_sample() -> int | None:
    """This rank's sample at which a planned ``crash:rank=R:phase=worker:sample=N`` kills its stream's
    data-loading worker (None: no such crash planned here)."""
    plan = fault_plan()
    due = (
        plan.get("kind") == "crash" and plan.get("phase") == "worker" and plan.get("rank") == dist_info().rank
    )
    return plan.get("sample") if due else None


# ---- preemption ---------------------------------------------------------------------------------


class PreemptionFlag:
    """Set by SIGTERM/SIGUSR1. The Trainer votes on it after every step (host-only), so all ranks
    finish the same step and save together."""

    def __init__(self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")):
        self.received: str | None = None
        self.at = 0.0
        for name in signals:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        """Only records the signal: it can arrive mid-collective, where saving is not safe."""
        self.received, self.at = signal.Signals(signum).name, time.monotonic()


# ---- hang watchdog ------------------------------------------------------------------------------


class Watchdog:
    """Labelled collective phases with a timeout.

    Entering a phase records the rank in the rendezvous store; a timer thread fires if the phase
    has not finished in time. Then this rank writes every thread's stack to
    ``output_dir/hang-<rank>.txt``, prints which ranks never reached the phase, and exits with
    EXIT_HANG. Every rank runs its own timer, so all ranks leave dumps.
    """

    def __init__(self, output_dir: str | Path, timeout_s: float, faults: dict[str, Any] | None = None):
        self.output_dir = Path(output_dir)
        self.timeout_s = timeout_s
        self.faults = faults or {}
        self._seq: Counter[str] = Counter()
        self.info = dist_info()

    @contextmanager
    def phase(self, label: str, timeout_s: float | None = None) -> Iterator[None]:
        """Run the body as phase ``label``; it ends with a named barrier, so a rank stuck anywhere
        in it (or never arriving) keeps every rank's timer running until it fires. Each entry
        gets its own store key, so an earlier pass of the same phase never counts."""
        self._seq[label] += 1
        key = f"trainer/phase/{label}/{self._seq[label]}"
        timeout = timeout_s or self.timeout_s
        timer = threading.Timer(timeout, self._fire, (label, key, timeout))
        timer.daemon = True
        timer.start()
        try:
            if self.faults.get("hang") == label and self.faults.get("rank") == self.info.rank:
                time.sleep(10 * timeout)  # fault injection: this rank never reaches the phase
            store = _store()
            if store is not None:
                store.set(f"{key}/{self.info.rank}", "1")
            yield
            barrier(label)
        finally:
            timer.cancel()

    def _fire(self, label: str, key: str, timeout: float) -> None:
        """Runs on the timer thread while the main thread is stuck: dump, report, hard-exit (a
        SystemExit from here would only end this thread). The store lives in one rank (or the
        launcher); once that one has exited, asking it fails, and this rank still exits."""
        store, world = _store(), self.info.world_size
        try:
            missing = [r for r in range(world) if store is not None and not store.check([f"{key}/{r}"])]
        except dist.DistError:
            missing, store = "unknown (the store is gone)", None
        message = (
            f"hang: phase '{label}' did not finish within {timeout:.0f}s on rank {self.info.rank}; "
            f"ranks that never reached it: {missing or 'none (all entered; see the stacks)'}"
        )
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.output_dir / f"hang-{self.info.rank}.txt", "w") as f:
            f.write(message + "\n\n")
            faulthandler.dump_traceback(f, all_threads=True)
        print(message, file=sys.stderr, flush=True)
        if store is not None:
            # Let the other ranks finish their dumps before the launcher tears the job down.
            with suppress(dist.DistError):
                store.add("trainer/hang/dumped", 1)
                deadline = time.monotonic() + 10
                while store.add("trainer/hang/dumped", 0) < world and time.monotonic() < deadline:
                    time.sleep(0.1)
        os._exit(EXIT_HANG)


def _store() -> Any:
    """The rendezvous store, where ranks mark the phases they entered so a timed-out one can name
    the missing ranks. None in a world of one: no peer can be missing."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return dist.distributed_c10d._get_default_store()


def save_failed(err: Exception, policy: str) -> None:
    """A checkpoint that could not be written (its partial files removed): ``stop`` exits with
    EXIT_SAVE_FAILED, ``continue`` warns and training goes on. One line either way, on rank 0."""
    if policy == "stop":
        print_main(f"error: {err}. Rerun once that is fixed: it resumes from the newest complete checkpoint.")
        raise SystemExit(EXIT_SAVE_FAILED)
    print_main(f"warning: {err}. Training goes on; the next save is tried as planned.")
