"""The output_dir lock on one machine: a live holder refuses others by name, a killed one leaves
nothing behind, a restart of the same job waits for its previous attempt, and an unwritable
directory is refused. The public command's side is tests/e2e/test_output_dir_lock.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.config.errors import ConfigError
from trainer.runtime import ownership

HOLD = """
import os, sys, time
from trainer.runtime import ownership
ownership.claim_output_dir(sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold(directory, seconds, **env):
    """A process that claims ``directory`` and keeps it for ``seconds``; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory), str(seconds)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    monkeypatch.setattr(ownership, "_claimed", set())
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_a_live_holder_is_named_and_a_killed_one_is_taken_over(tmp_path):
    holder = hold(tmp_path / "out", 60)
    try:
        with pytest.raises(ConfigError) as err:
            ownership.claim_output_dir(tmp_path / "out")
        message = str(err.value)
        assert message.startswith(
            f"output_dir: {tmp_path / 'out'} is in use by another run (pid {holder.pid} on "
        )
        assert message.endswith("Wait for it to end or stop it, or choose another --output_dir.")
        assert "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    ownership.claim_output_dir(tmp_path / "out")  # the dead holder's lock is free
    ownership.claim_output_dir(tmp_path / "out")  # idempotent in the owning process
    assert f'"pid": {os.getpid()}' in (tmp_path / "out" / ownership.LOCK_FILE).read_text()


def test_a_restart_of_the_same_job_waits_for_its_previous_attempt(tmp_path, monkeypatch):
    holder = hold(tmp_path / "out", 2, TORCHELASTIC_RUN_ID="job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    start = time.monotonic()
    ownership.claim_output_dir(tmp_path / "out", wait_s=30)
    waited = time.monotonic() - start
    # The claim came once the holder let go at its end (it sleeps 2 s after claiming), not before.
    assert 1.5 < waited < 25, waited
    assert holder.wait(timeout=5) == 0  # it held the lock until it ended, by itself
    assert f'"pid": {os.getpid()}' in (tmp_path / "out" / ownership.LOCK_FILE).read_text()


def test_another_job_is_refused_without_waiting(tmp_path, monkeypatch):
    holder = hold(tmp_path / "out", 60, TORCHELASTIC_RUN_ID="job-7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match="job torchrun:job-7"):
            ownership.claim_output_dir(tmp_path / "out", wait_s=30)
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()


def test_an_unwritable_output_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError, match=r"^output_dir: .*file/out: cannot write there \(Not a directory\)$"
    ):
        ownership.claim_output_dir(tmp_path / "file" / "out")
