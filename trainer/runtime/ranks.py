"""This process's place in the job, read from the launcher's environment, the logging set up for
it, the codes it exits with and its last wait for gloo's worker threads. Nothing here imports torch:
a command answers ``--help`` or refuses bad input with these alone (``trainer.runtime.distributed``,
which starts and leaves the process group, re-exports them).

Works the same under the ``deepspeed`` launcher, ``torchrun``, ``accelerate launch``, SLURM
(``SLURM_PROCID`` and friends) and plain ``python`` (a world of one).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def dist_info() -> DistInfo:
    """Rank facts from the launcher's environment: torchrun/deepspeed, then OpenMPI, then SLURM."""
    return DistInfo(
        rank=_env_int("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", default=0),
        local_rank=_env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", default=0),
        world_size=_env_int("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", default=1),
    )


# Distinct exit codes, so a supervisor (SLURM requeue, torchrun restarts) can tell a stop to resume from
# a failure to look at.
EXIT_SAVE_FAILED = 74  # a checkpoint could not be written (a full disk...) with save_failure_policy=stop
EXIT_PREEMPTED = 75  # saved a checkpoint on SIGTERM/SIGUSR1 and stopped; restart to continue
EXIT_HANG = 76  # a labelled phase timed out; stack dumps are in output_dir/hang-<rank>.txt
EXIT_NONFINITE = 77  # non-finite loss or gradient norm with nonfinite_policy=stop


LOG_HANDLER = "trainer"  # the name of the handler configure_logging adds to the root logger


def configure_logging() -> None:
    """Rank 0 shows the project's INFO lines (tokenizer, tokenisation, cache hits, skipped rows); other
    ranks only warnings. One plain stderr handler goes on the root logger, replacing an earlier one of
    ours, so other libraries' warnings share the format. transformers and datasets keep to their
    warnings; off rank 0 to errors, with no progress bars. Their verbosity variables, if set, win.
    Each warning shows once per process, unless the user chose how warnings show (``-W``,
    ``PYTHONWARNINGS``): see ``show_each_warning_once``."""
    if not sys.warnoptions:
        show_each_warning_once()
    info = dist_info()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == LOG_HANDLER]:
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.set_name(LOG_HANDLER)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {info.rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root.addHandler(handler)
    logging.getLogger("trainer").setLevel(logging.INFO if info.is_main else logging.WARNING)

    # Each library reads these variables once, when imported; one imported already is told directly.
    level = logging.WARNING if info.is_main else logging.ERROR
    for library in ("transformers", "datasets"):
        variable = f"{library.upper()}_VERBOSITY"
        if variable not in os.environ:
            os.environ[variable] = logging.getLevelName(level).lower()
            if library in sys.modules:
                importlib.import_module(f"{library}.utils.logging").set_verbosity(level)
    if not info.is_main:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            importlib.import_module("transformers.utils.logging").disable_progress_bar()
        if "datasets" in sys.modules:
            importlib.import_module("datasets").disable_progress_bars()


def show_each_warning_once() -> None:
    """Print a warning's category and message the first time only. Python's own record of the
    warnings shown is forgotten by every ``warnings.catch_warnings`` block, anywhere in the process
    (``subprocess`` has one per call), so a warning from a library's every step (torch's for the
    deprecated collectives DeepSpeed calls) would print again and again."""
    show = warnings.showwarning
    if hasattr(show, "shown"):
        return
    shown: set[tuple[type, str]] = set()

    def show_once(
        message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None
    ):
        key = (category, str(message))
        if key not in shown:
            shown.add(key)
            show(message, category, filename, lineno, file, line)

    show_once.shown = shown
    warnings.showwarning = show_once


# ---- the end of a rank ---------------------------------------------------------------------------

GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives a gloo group's worker threads


def settle_gloo_workers(timeout_s: float = 2.0, poll_s: float = 0.005) -> None:
    """Wait, the GIL released, until no gloo worker thread of this process is running.

    Leaving the group does not stop its workers while DeepSpeed still holds the group (the engine,
    every ZeRO-3 parameter). A worker drops each collective it ran after the caller has its result;
    when that collective's tensor lives on only as a Python object (the caller let go of it first),
    dropping it takes the GIL. A worker that asks for the GIL once the interpreter is finalizing is
    ended by Python inside a C++ destructor, and the process aborts: "terminate called without an
    active exception", exit -6, after a run that had finished (a rank descheduled on a busy machine
    lands there). A worker that is idle or waits for the GIL sleeps; sleeping here hands the GIL over;
    so the wait ends once every worker was seen asleep at two polls in a row. Without workers (no
    gloo group, or no /proc) it returns at once."""
    tasks = Path("/proc/self/task")
    deadline, calm = time.monotonic() + timeout_s, 0
    while calm < 2 and time.monotonic() < deadline:
        states = _thread_states(tasks, GLOO_WORKER)
        if not states:
            return
        calm = calm + 1 if "R" not in states else 0
        time.sleep(poll_s)


def _thread_states(tasks: Path, name: str) -> list[str]:
    """The scheduler states ("R" running, "S" asleep...) of this process's threads called ``name``."""
    states = []
    for task in tasks.glob("[0-9]*") if tasks.is_dir() else ():
        try:
            if (task / "comm").read_text().strip() == name:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return states
