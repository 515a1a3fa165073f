"""scripts/train.py across two simulated nodes, through real launchers.

Two torchrun agents on this machine (``--nnodes=2 --nproc_per_node=1``, c10d rendezvous on
localhost) form one 2-rank job, as two hosts would. It must train to the same result as one node
with 2 ranks: the launch matrix's run of the README's command, with the same arguments. (The
matrix's ``deepspeed-pipeline2-checkpointing`` case runs ``--pipeline_parallel_size 2``.)
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers.launch import BIN, ROOT, free_port, run_env
from tests.helpers.matrix import CASES, STEPS, TINY
from tests.helpers.scaffold import assert_same_weights, read_metrics, train_rows

pytestmark = pytest.mark.distributed

ONE_NODE = "deepspeed-default"  # the matrix case with no arguments of its own


def two_agents(out: Path, timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one rank each, meeting through a c10d rendezvous on localhost."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    cmd = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=localhost:{port}", f"--rdzv_id={run_id}",
           "scripts/train.py", "--output_dir", str(out), *TINY, *CASES[ONE_NODE].args]  # fmt: skip
    agents = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    done = []
    for agent in agents:
        try:
            stdout, _ = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in agents:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(cmd, agent.returncode, stdout, ""))
    for proc in done:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    return done


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Path, list[subprocess.CompletedProcess]]:
    out = tmp_path_factory.mktemp("multinode") / "two_nodes"
    return out, two_agents(out)


def eval_loss(out: Path) -> float:
    return [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r][-1]


def assert_same_training(got: Path, ref: Path, rtol: float) -> None:
    a, b = train_rows(got), train_rows(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= rtol * y["loss"], (x["step"], x["loss"], y["loss"])
    assert abs(eval_loss(got) - eval_loss(ref)) <= rtol * eval_loss(ref)
    assert_same_weights(got / "final", ref / "final", rtol=rtol, atol=1e-6)


def test_two_nodes_train_to_the_one_node_result(two_nodes, matrix_runs):
    out, _ = two_nodes
    assert_same_training(out, matrix_runs(ONE_NODE).out, rtol=1e-5)


def test_two_nodes_form_one_job_of_two_ranks(two_nodes):
    out, agents = two_nodes
    manifest = json.loads((out / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    # Exactly one agent ran global rank 0 (it prints the summary and the sample completion).
    assert sum("Sample completion:" in a.stdout for a in agents) == 1
    assert (out / "final" / "config.json").is_file()
