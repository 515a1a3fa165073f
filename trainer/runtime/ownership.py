"""One owner per ``output_dir``: a run holds an exclusive lock on it for its whole life.

Rank 0 takes an ``flock`` on ``output_dir/.trainer.lock`` and keeps the file open until the process
ends, so the kernel releases the lock on exit, crash or ``kill -9``: a lock left by a dead process is
simply free, and taking it over is the same atomic ``flock``. The file names the holder (host, pid,
start time, job), so a second run is refused with one line saying who has the directory. A restart
of the same job (torchrun's run id, SLURM's job id) waits for its previous attempt's process to be
gone instead of being refused.

``flock`` works on local filesystems and on NFSv4 (where Linux maps it to a POSIX lock); on a
filesystem without locks the claim fails with the system's reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.config.errors import ConfigError
from trainer.runtime.distributed import dist_info

LOCK_FILE = ".trainer.lock"

_claimed: set[str] = set()  # output dirs this process's job holds
_open_locks: list[int] = []  # rank 0's lock files, open for the life of the process


def claim_output_dir(output_dir: str | Path, wait_s: float = 0.0) -> None:
    """Make this job the owner of ``output_dir`` (collective; idempotent within a process). Every
    rank raises the same ``ConfigError`` naming ``output_dir`` when another run holds it, or when it
    cannot be written. ``wait_s``: how long a restart of the same job waits for its previous attempt."""
    key = str(Path(output_dir).resolve())
    if key in _claimed:
        return
    problem = _lock(Path(key), wait_s) if dist_info().is_main else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError([("output_dir", problem)])
    _claimed.add(key)


def job_id() -> str | None:
    """The launcher's id of this job, the same across its restarts: torchrun's run id, SLURM's job id."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in ("", "none"):
        return f"torchrun:{run_id}"
    return f"slurm:{os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else None


def _lock(directory: Path, wait_s: float) -> str | None:
    """Rank 0's half: take the lock (None) or say why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        return f"{directory}: cannot write there ({err.strerror})"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(fd)
            same_job = holder.get("job") is not None and holder.get("job") == job_id()
            if not same_job or time.monotonic() > deadline:
                os.close(fd)
                return _busy(directory, holder)
            time.sleep(0.5)
        except OSError as err:
            os.close(fd)
            return f"{directory}: cannot lock it ({err.strerror})"
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "job": job_id(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    _open_locks.append(fd)
    return None


def _holder(fd: int) -> dict[str, Any]:
    """What the lock file says of its holder; empty while the holder has not written it yet."""
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def _busy(directory: Path, holder: dict[str, Any]) -> str:
    who = (
        f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        + (f", job {holder['job']}" if holder.get("job") else "")
        if {"pid", "host", "started"} <= set(holder)
        else "another process"
    )
    return (
        f"{directory} is in use by another run ({who}). Wait for it to end or stop it, "
        "or choose another --output_dir."
    )
