"""Launching real runs in subprocesses: the environment they get, the launchers, free ports, the
DeepSpeed all-reduce buffers a run leaves in /dev/shm."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SITE = ROOT / "tests" / "helpers" / "site"  # its sitecustomize: see there
T = TypeVar("T")


def run_env(**extra: str) -> dict[str, str]:
    # A process group this test process started (a world of one picks its own port) is not the
    # child's: the launcher sets its own rendezvous, and a plain child picks a free port.
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(SITE), env.get("PYTHONPATH", "")])
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONFAULTHANDLER="1",  # a rank that aborts prints its Python stacks
    )
    env.update(extra)
    return env


def launch(
    args: list[str],
    nproc: int = 2,
    launcher: str = "torchrun",
    timeout: int = 900,
    check: bool = True,
    env: dict[str, str] | None = None,
    restarts: int = 0,
) -> subprocess.CompletedProcess:
    """Run a script under a real launcher; on failure the output is part of the assertion message.
    ``restarts``: how many times torchrun's elastic agent restarts the ranks after one fails.

    torchrun unless a test names another: the deepspeed launcher imports DeepSpeed twice before the
    ranks start (about 9 s a launch here), so it is used where it is the door under test (the launch
    matrix, the README's commands, HF's scripts, the hang dump).
    """
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), *args]
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", f"--max-restarts={restarts}",
               f"--master_port={free_port()}", *args]  # fmt: skip
    elif launcher == "accelerate":
        # --multi_gpu: without it accelerate starts one process where it sees no GPUs.
        cmd = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", str(nproc),
               "--main_process_port", str(free_port()), *args]  # fmt: skip
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env or run_env(), capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
            f"\n---- why, from the whole stderr ----\n{why_it_failed(proc.stderr)}"
        )
    return proc


# Lines that say why a rank died: a C++ abort, faulthandler's stacks (PYTHONFAULTHANDLER is set in
# run_env) and Python's tracebacks.
_WHY = re.compile(r"terminate called|Fatal Python error|Error|Exception|Thread 0x|Current thread|File \"")


def why_it_failed(stderr: str, keep: int = 60) -> str:
    """The last ``keep`` lines of ``stderr`` that say why a process died, last in the assertion
    message: a rank's abort is otherwise lost among thousands of lines of its peers' logs."""
    return "\n".join([line for line in stderr.splitlines() if _WHY.search(line)][-keep:])


def together(*runs: Callable[[], T]) -> list[T]:
    """Independent runs at once, their results in order; the first failure is raised once all are
    done. For a launch of several ranks with a one-process run beside it: the ranks leave a core idle
    while their launcher starts, while they wait on each other and while rank 0 alone exports, and
    the one-process run fills it."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(run) for run in runs]
        wait(futures)
    return [future.result() for future in futures]


def shm_buffers() -> set[str]:
    """This user's DeepSpeed CPU all-reduce buffers now in /dev/shm."""
    from trainer.runtime.distributed import SHM_BUFFER_PREFIX

    return {p.name for p in Path("/dev/shm").glob(f"{SHM_BUFFER_PREFIX}{os.getuid()}_*")}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_launcher() -> bool:
    return shutil.which("deepspeed", path=str(BIN)) is not None
