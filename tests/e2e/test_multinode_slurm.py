"""The SLURM batch scripts, run by bash against stand-in ``srun``/``scontrol``/``deepspeed`` commands.

The stand-ins record what they were asked to run, so the tests check the launch lines the scripts
build from a 2-node allocation, and the SIGUSR1 -> checkpoint -> requeue path, without a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, run_env

SLURM_ENV = {
    "SLURM_JOB_NODELIST": "gpu-[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "4242",
    "GPUS_PER_NODE": "4",
}

SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-01\\ngpu-02\\n'; fi
"""
# Records its command line, then runs until told to stop: like a job step, SIGUSR1 makes its
# ranks save and exit with the preemption code.
SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun.args"
trap 'echo usr1 >> "$FAKE_LOG"; exit 75' USR1
touch "$FAKE_DIR/started"
if [ -n "${FAKE_WAIT:-}" ]; then for _ in $(seq 300); do sleep 0.1; done; fi
"""
DEEPSPEED = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/deepspeed.args"
"""


@pytest.fixture
def fake(tmp_path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("deepspeed", DEEPSPEED)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return {
        **run_env(),  # not a rendezvous an earlier in-process run of this test process left
        **SLURM_ENV,
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "log"),
        "TRAINER_BIN": str(bindir),
        "HOSTFILE": str(tmp_path / "hostfile"),
    }


def sbatch(script: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", f"scripts/slurm/{script}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.parametrize("script", ["train.sbatch", "deepspeed.sbatch"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "slurm" / script)]).returncode == 0


def test_one_torchrun_agent_per_node_meets_at_the_first_node(fake):
    proc = sbatch("train.sbatch", fake, "--config", "scripts/recipes/default.yaml", "--max_steps", "5")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    args = (Path(fake["FAKE_DIR"]) / "srun.args").read_text().splitlines()
    assert args[:3] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", f"{fake['TRAINER_BIN']}/torchrun"]
    for flag in ("--nnodes=2", "--nproc_per_node=4", "--rdzv_id=4242", "--rdzv_backend=c10d",
                 "--rdzv_endpoint=gpu-01:29500", "--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"):  # fmt: skip
        assert flag in args, flag
    assert args[args.index("scripts/train.py") :] == [
        "scripts/train.py", "--config", "scripts/recipes/default.yaml", "--max_steps", "5"]  # fmt: skip
    assert "requeue" not in (Path(fake["FAKE_DIR"]) / "log").read_text()


def test_time_limit_signal_checkpoints_and_requeues(fake):
    proc = sbatch("train.sbatch", {**fake, "FAKE_WAIT": "1"}, "--output_dir", "/shared/run")
    started = Path(fake["FAKE_DIR"]) / "started"
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "srun was not started"
    proc.send_signal(signal.SIGUSR1)  # what SLURM's --signal=B:USR1@300 delivers to the batch shell
    out, _ = proc.communicate(timeout=30)
    log = (Path(fake["FAKE_DIR"]) / "log").read_text().splitlines()
    assert proc.returncode == 75, out  # the ranks' "saved a checkpoint on a signal" exit code
    assert "usr1" in log  # forwarded to the job step
    assert log[-1] == "scontrol requeue 4242"
    assert "requeueing job 4242" in out


def test_deepspeed_launcher_gets_a_hostfile_and_the_master(fake):
    proc = sbatch("deepspeed.sbatch", fake, "--config", "scripts/recipes/default.yaml")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert Path(fake["HOSTFILE"]).read_text() == "gpu-01 slots=4\ngpu-02 slots=4\n"
    args = (Path(fake["FAKE_DIR"]) / "deepspeed.args").read_text().splitlines()
    assert args[:8] == ["--hostfile", fake["HOSTFILE"], "--launcher", "slurm",
                        "--master_addr", "gpu-01", "--master_port", "29500"]  # fmt: skip
    assert args[-3:] == ["scripts/train.py", "--config", "scripts/recipes/default.yaml"]
