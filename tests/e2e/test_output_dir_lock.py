"""Two runs in one output_dir, through ``scripts/train.py``: the second is refused with one line
naming the holder, on every rank, before it loads or writes anything (every file of the holder's
directory, its lock file included, keeps its bytes); once the holder is killed -9, the next run takes
the directory over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.launch import ROOT, launch, run_env
from tests.helpers.scaffold import file_digests, read_metrics, tiny_flags

pytestmark = pytest.mark.distributed

TINY = tiny_flags(max_steps=None, save_steps=1000, eval_steps=1000, max_train_samples=400, max_eval_samples=8)


def test_a_second_run_is_refused_and_a_killed_holder_is_taken_over(tmp_path):
    out = tmp_path / "run"
    lock = out / ".trainer.lock"
    first = subprocess.Popen(
        [sys.executable, "scripts/train.py", "--output_dir", str(out), *TINY, "--max_steps", "100000"],
        cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        # The holder has written its files (lock, configs, a logged step) before it is paused: the
        # directory then holds what a refused run could damage, and nothing moves while it is tried.
        deadline = time.monotonic() + 180
        while not read_metrics(out, missing_ok=True):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGSTOP)  # a stopped process keeps its flock
        holder = json.loads(lock.read_text())
        assert holder["pid"] == first.pid
        before = file_digests(out)
        assert {".trainer.lock", "metrics.jsonl", "run_config.yaml", "ds_config.json"} <= set(before)
        second = launch(
            ["scripts/train.py", "--output_dir", str(out), *TINY, "--max_steps", "2"],
            launcher="deepspeed",  # torchrun prints a traceback of its own for a failed rank
            check=False,
        )
        text = second.stdout + second.stderr
        assert second.returncode == 2, text
        refusals = [line for line in text.splitlines() if line.startswith("error:")]
        assert refusals == [
            f"error: output_dir: {out} is in use by another run (pid {first.pid} on {holder['host']}, "
            f"started {holder['started']}). Wait for it to end or stop it, or choose another --output_dir."
        ]
        assert "Traceback" not in text and "tokeni" not in text  # refused before any data loaded
        # Nothing written, added or removed; the lock file too keeps the holder's record, which the
        # next refusal reads.
        assert file_digests(out) == before
        os.killpg(first.pid, signal.SIGCONT)
        assert first.poll() is None  # the holder trains on
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = launch(
        ["scripts/train.py", "--output_dir", str(out), *TINY, "--max_steps", "2"], launcher="python"
    )
    assert "No complete checkpoint" in third.stdout + third.stderr
    assert json.loads(lock.read_text())["pid"] != first.pid
