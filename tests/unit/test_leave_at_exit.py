"""How a rank of a user's own script (one that never leaves the process group) ends: it waits for
the other ranks before tearing the group down, unless it ends on an uncaught exception."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.launch import free_port, run_env

# Rank 0 lingers after the last collective, as it does while it writes an export alone.
SCRIPT = """
import os, sys, time
from trainer.runtime.distributed import detect_hardware, init_distributed
init_distributed(detect_hardware())
if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[1]))
    print("done", time.time(), flush=True)  # the moment rank 0 is done: rank 1 must not have left before it
elif sys.argv[2] == "raise":
    raise RuntimeError("rank 1 failed")
"""


def _two_ranks(linger_s: float, rank1: str) -> tuple[dict[int, tuple[float, int]], str]:
    """Start both ranks; each rank's (wall-clock time of its exit, exit code), and rank 0's output."""
    port = str(free_port())
    procs = {
        rank: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(linger_s), rank1],
            env=run_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    }
    ended = {}
    while len(ended) < 2:
        for rank, proc in procs.items():
            if rank not in ended and proc.poll() is not None:
                ended[rank] = (time.time(), proc.returncode)
        time.sleep(0.05)
    return ended, procs[0].stdout.read()


@pytest.mark.parametrize("rank1", ["ends", "raise"])
def test_a_rank_waits_for_the_others_unless_it_failed(rank1):
    linger = 6.0
    ended, rank0_output = _two_ranks(linger, rank1)
    (t0, rc0), (t1, rc1) = ended[0], ended[1]
    if rank1 == "ends":
        assert rc0 == rc1 == 0
        # Measured against the moment rank 0 was done, not its exit, which a loaded machine delays.
        done = float(next(line for line in rank0_output.splitlines() if line.startswith("done ")).split()[1])
        assert t1 >= done, f"rank 1 left {done - t1:.1f}s before rank 0 was done"
    else:
        assert rc1 == 1
        assert t1 < t0 - linger / 2, f"the failed rank 1 waited: {t1:.1f}s, rank 0 {t0:.1f}s"


# A thread that calls itself a gloo worker, computes for a while without the GIL (hashing a large
# buffer), then sleeps as an idle worker does.
WORKER = """
import ctypes, hashlib, sys, threading, time
from trainer.runtime.ranks import GLOO_WORKER, settle_gloo_workers

def worker(seconds, done):
    ctypes.CDLL(None).prctl(15, GLOO_WORKER.encode())  # PR_SET_NAME: this thread's name in /proc
    data = bytes(8 << 20)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hashlib.sha256(data).digest()
    done.append(time.monotonic())
    time.sleep(60)

done = []
threading.Thread(target=worker, args=(float(sys.argv[1]), done), daemon=True).start()
time.sleep(0.2)  # the worker has named itself and is computing
settle_gloo_workers(timeout_s=float(sys.argv[2]))
print(len(done), time.monotonic() - done[0] if done else -1.0)
"""


def _settle(work_s: float, timeout_s: float) -> tuple[int, float]:
    """(whether the worker had finished computing when settle_gloo_workers returned, seconds since)."""
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(work_s), str(timeout_s)],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    finished, since = proc.stdout.split()
    return int(finished), float(since)


def test_exit_waits_while_a_gloo_worker_runs_then_returns_once_it_sleeps():
    """A gloo worker still running at exit (it may yet ask for the GIL, which aborts the process
    once finalization began) holds the exit back until it sleeps; an idle one does not."""
    finished, since = _settle(work_s=1.5, timeout_s=10)
    assert finished == 1 and since < 1.0, (finished, since)


def test_exit_gives_up_on_a_worker_that_never_sleeps():
    finished, _ = _settle(work_s=30, timeout_s=0.5)
    assert finished == 0
