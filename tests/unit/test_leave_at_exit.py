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
