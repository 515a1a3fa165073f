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
elif sys.argv[2] == "raise":
    raise RuntimeError("rank 1 failed")
"""


def _two_ranks(linger_s: float, rank1: str) -> dict[int, tuple[float, int]]:
    """Start both ranks; each rank's (seconds to exit, exit code)."""
    port = str(free_port())
    start = time.monotonic()
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
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    }
    ended = {}
    while len(ended) < 2:
        for rank, proc in procs.items():
            if rank not in ended and proc.poll() is not None:
                ended[rank] = (time.monotonic() - start, proc.returncode)
        time.sleep(0.05)
    return ended


@pytest.mark.parametrize("rank1", ["ends", "raise"])
def test_a_rank_waits_for_the_others_unless_it_failed(rank1):
    linger = 6.0
    ended = _two_ranks(linger, rank1)
    (t0, rc0), (t1, rc1) = ended[0], ended[1]
    if rank1 == "ends":
        assert rc0 == rc1 == 0
        assert t1 >= t0 - 1.0, f"rank 1 left at {t1:.1f}s, before rank 0 was done at {t0:.1f}s"
    else:
        assert rc1 == 1
        assert t1 < t0 - linger / 2, f"the failed rank 1 waited: {t1:.1f}s, rank 0 {t0:.1f}s"
