"""Crashes and hangs through the real launchers (CPU, 2 ranks, fp32).

A reference run trains uninterrupted; the others are killed or hung and must end with exactly the
reference's final weights (or a clear non-zero exit for a hang). Preemption (SIGTERM, exit 75 and the
requeue) and a kill that resumes from a flash snapshot run in ``test_fault_campaign.py``, through
``scripts/fault_campaign.py``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers.launch import BIN, ROOT, free_port, launch, run_env
from tests.helpers.scaffold import assert_same_weights, load_weights, loss_steps, tiny_flags
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.distributed

# Small and quick: checkpoints every 4 steps, a metrics row every step.
RUN = tiny_flags(max_steps=16, eval_steps=None, eval_strategy="no", max_train_samples=256, max_eval_samples=8,
                 block_size=32, model_config_overrides=None)  # fmt: skip


def torchrun_cmd(out: Path, max_restarts: int = 0) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node=2",
        f"--max-restarts={max_restarts}",
        f"--master_port={free_port()}",
        "scripts/train.py",
        "--output_dir",
        str(out),
        *RUN,
    ]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_weights(out / "final")


def resumed_at(output: str, out: Path) -> int:
    """The step the job resumed at (0: it started from scratch), checked two ways: the Trainer's
    one "Resumed from <out>/checkpoint-<k> at step <k>." line, and metrics.jsonl, where the
    interrupted attempt's rows 1..m are followed by rows k+1..16 (a silent restart from scratch
    would log step 1 again)."""
    total = int(RUN[RUN.index("--max_steps") + 1])
    found = re.findall(r"Resumed from (\S+) at step (\d+)\.", output)
    assert len(found) <= 1, found
    step = int(found[0][1]) if found else 0
    if found:
        assert found[0][0] == str(out / f"checkpoint-{step}"), found
    logged = loss_steps(out)
    before = len(logged) - (total - step)  # rows of the interrupted attempt
    assert before >= step, (step, logged)
    assert logged == list(range(1, before + 1)) + list(range(step + 1, total + 1)), (step, logged)
    return step


def worker(agent: subprocess.Popen, rank: int) -> psutil.Process | None:
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        logged = loss_steps(out, missing_ok=True)  # polled from the start: no file yet reads as no rows
        if logged and max(logged) >= step:
            return
        assert proc.poll() is None, "the run ended before the fault could be injected"
        time.sleep(0.05)
    raise TimeoutError(f"step {step} never logged")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("reference") / "run"
    subprocess.run(
        torchrun_cmd(out), cwd=ROOT, env=run_env(), check=True, capture_output=True, text=True, timeout=900
    )
    return final_weights(out)


def kill_rank_and_recover(out: Path, kill_after: int) -> subprocess.CompletedProcess:
    agent = subprocess.Popen(
        torchrun_cmd(out, max_restarts=2),
        cwd=ROOT,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(out, kill_after, agent)
    victim = worker(agent, rank=1)
    assert victim is not None
    victim.send_signal(signal.SIGKILL)  # from outside, as the OOM killer or a lost node would
    output, _ = agent.communicate(timeout=900)
    return subprocess.CompletedProcess(agent.args, agent.returncode, output, "")


def kill_point(low: int, high: int) -> int:
    """The step after which a rank is killed, drawn from ``FAULT_SEED`` (a fresh seed when unset). The
    seed is printed: pytest shows it with a failure, and ``FAULT_SEED=<seed>`` replays the same point."""
    seed = int(os.environ.get("FAULT_SEED") or random.SystemRandom().randrange(2**32))
    step = random.Random(seed).randint(low, high)
    print(f"kill point: after step {step}; replay with FAULT_SEED={seed}")
    return step


def test_sigkill_of_a_rank_restarts_and_matches_uninterrupted(tmp_path, reference):
    kill_after = kill_point(5, 7)  # between checkpoints 4 and 8
    proc = kill_rank_and_recover(tmp_path / "run", kill_after)
    assert proc.returncode == 0, proc.stdout[-4000:]
    step = resumed_at(proc.stdout, tmp_path / "run")
    # checkpoint-4, or checkpoint-8 if the run got that far before the signal landed.
    assert step in (4, 8), f"killed after step {kill_after}; resumed at {step}"
    assert_same_weights(final_weights(tmp_path / "run"), reference)


@pytest.mark.slow
@pytest.mark.parametrize("kill_after", [1, 3, 4, 6, 9, 13, 15])
def test_sigkill_at_many_points(tmp_path, reference, kill_after):
    proc = kill_rank_and_recover(tmp_path / "run", kill_after)
    assert proc.returncode == 0, proc.stdout[-4000:]
    step = resumed_at(proc.stdout, tmp_path / "run")
    # The newest checkpoint (every 4 steps) before the kill, or the one before it if the kill
    # landed while that one was being saved.
    assert step % 4 == 0 and kill_after - 4 <= step <= kill_after + 4, (kill_after, step)
    if kill_after >= 5:
        assert step > 0, f"killed after step {kill_after}; no resume seen"
    assert_same_weights(final_weights(tmp_path / "run"), reference)


def test_sigkill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, reference):
    """Rank 1 is SIGKILLed inside the save of step 8 (asynchronous saves: its background writer is
    busy), before the ranks' vote. checkpoint-4 stays complete and verified, the partial save of
    step 8 is never taken for a checkpoint, and a new job resumes from 4 to the reference weights."""
    out = tmp_path / "run"
    cmd = [*torchrun_cmd(out), "--async_save", "true"]
    killed = subprocess.run(
        cmd, cwd=ROOT, env=run_env(TRAINER_FAULT="crash:rank=1:step=8:phase=save"),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert killed.returncode != 0
    assert (out / ".staging-checkpoint-8" / "ds").is_dir()  # the partial save is there...
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-4"]  # ...and ignored
    assert ckpt.verify(out / "checkpoint-4") == []
    resumed = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert resumed_at(resumed.stdout, out) == 4
    assert not (out / ".staging-checkpoint-8").exists()
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-12", "checkpoint-16"]  # limit 2
    assert_same_weights(final_weights(out), reference)


def test_hang_in_save_dumps_every_rank_and_exits(tmp_path):
    out = tmp_path / "run"
    proc = launch(
        ["scripts/train.py", "--output_dir", str(out), *RUN, "--hang_timeout_s", "10"],
        launcher="deepspeed",
        check=False,
        env=run_env(TRAINER_FAULT="hang:rank=1:phase=save"),
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "hang: phase 'save' did not finish within 10s" in text and "never reached it: [1]" in text
    for rank in (0, 1):
        dump = (out / f"hang-{rank}.txt").read_text()
        assert "phase 'save'" in dump and "File " in dump  # a real stack trace follows the message
    assert "in phase" in (out / "hang-1.txt").read_text()  # rank 1 is caught where it stalls
    # The stalled rank exits by itself once its dump is written, though rank 0 (and the store it
    # holds) went first: its watchdog does not die asking the store, leaving the launcher to kill it.
    assert "Exception in thread" not in text, text[-3000:]
    # It stalled in the first save (step 4) and nothing was committed.
    assert max(loss_steps(out)) == 4 and not (out / "checkpoint-4").exists()
