"""Starting the systems and handing the turn round: the coordinator's side of ``scripts/bench.py``.

Each system runs under its own ``deepspeed`` launcher with the same number of ranks, every rank a
``python -m trainer.bench.worker`` process (the launcher's ``--module``). All are started together
and take turns, ``job.chunk`` steps at a time, through the ``gate`` coordinator.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainer.bench.gate import Coordinator, Group, WorkerFailed
from trainer.bench.job import Job

WORKER_MODULE = "trainer.bench.worker"
# The directory that holds the ``trainer`` package (the repository root in a checkout): the launchers
# run there, and the ranks import the same ``trainer`` as the coordinator.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(job: Job, token: str, n_systems: int) -> dict[str, str]:
    env = dict(os.environ)
    env["BENCH_TOKEN"] = token
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if job.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # The ranks of one system share the cores; the other systems wait for their turn.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.world_size)))
    else:
        # Host threads matter only while the systems build their models, all at once.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (job.world_size * n_systems))))
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def worker_command(system: str, job: Job, job_file: Path, gate: str) -> list[str]:
    """One system's launcher: ``job.world_size`` ranks of ``python -m trainer.bench.worker``."""
    return [
        sys.executable, "-m", "deepspeed.launcher.runner",
        "--num_gpus", str(job.world_size), "--master_port", str(free_port()),
        "--module", WORKER_MODULE,
        "--system", system, "--job", str(job_file), "--gate", gate,
    ]  # fmt: skip


def start_group(coord: Coordinator, system: str, job: Job, out: Path, env: dict[str, str]) -> None:
    log = out / "logs" / f"{system}.log"
    cmd = worker_command(system, job, out / "job.json", coord.address)
    with log.open("w") as handle:
        # A session of its own, so a failure can stop the launcher and every rank it started.
        proc = subprocess.Popen(
            cmd, cwd=PACKAGE_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    coord.groups[system] = Group(system, proc, log)


def run_systems(job: Job, systems: list[str], out: Path, start_timeout: float, step_timeout: float) -> dict:
    """Start every system, hand the turn round until all finish; returns each rank's result."""
    coord = Coordinator(secrets.token_hex(16))
    env = worker_env(job, coord.token, len(systems))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    try:
        for system in systems:
            start_group(coord, system, job, out, env)
        t0 = time.monotonic()
        coord.accept_all(job.world_size, start_timeout)
        say(f"{len(systems)} systems started ({time.monotonic() - t0:.0f}s); {job.chunk} step(s) a turn")
        live, rounds = list(systems), 0
        while live:
            rounds += 1
            if rounds in (2, 1 + -(-job.steps // job.chunk) // 2):
                say(f"round {rounds} of {-(-job.steps // job.chunk)} ({time.monotonic() - t0:.0f}s)")
            for system in list(live):
                messages = coord.turn(system, step_timeout)
                if all("result" in m for m in messages):
                    results[system] = [m["result"] for m in messages]
                    live.remove(system)
                elif any("result" in m for m in messages):
                    raise WorkerFailed(f"{system}: its ranks disagree on when training ended")
        for group in coord.groups.values():
            if group.proc.wait(timeout=300) != 0:
                raise WorkerFailed(
                    f"{group.system}: the launcher exited with {group.proc.returncode}; see {group.log}"
                )
        return results
    except (WorkerFailed, TimeoutError, subprocess.TimeoutExpired, ConnectionError, KeyboardInterrupt) as err:
        _stop(coord)
        for group in coord.groups.values():
            say(f"--- {group.system}: last lines of {group.log}\n" + _tail(group.log))
        raise SystemExit(f"bench: {err}") from None
    finally:
        coord.close()


def _stop(coord: Coordinator) -> None:
    """Stop every launcher this run started, with all its ranks (each launcher leads its own session)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        for group in coord.groups.values():
            if group.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group.proc.pid, sig)
        for group in coord.groups.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                group.proc.wait(timeout=wait_s)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)
