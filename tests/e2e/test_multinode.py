"""scripts/train.py across two simulated nodes, and with a 2-stage pipeline, through real launchers.

Two torchrun agents on this machine (``--nnodes=2 --nproc_per_node=1``, c10d rendezvous on
localhost) form one 2-rank job, as two hosts would. It must train to the same result as one node
with 2 ranks. The same reference checks ``--pipeline_parallel_size 2`` under the deepspeed launcher.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers.launch import BIN, ROOT, free_port, launch, run_env
from tests.helpers.scaffold import assert_same_weights, read_metrics, tiny_flags, train_rows

pytestmark = pytest.mark.distributed

# A tiny run of the embedded default recipe: ZeRO-1 so the pipeline run can use the same settings.
TINY = tiny_flags(max_steps=8, logging_steps=2, save_steps=8, eval_steps=8, zero_stage=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def one_node(runs) -> Path:
    out = runs / "one_node"
    launch(["scripts/train.py", "--output_dir", str(out), *TINY], nproc=2, launcher="torchrun")
    return out


def two_agents(out: Path, timeout: int = 900) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, one rank each, meeting through a c10d rendezvous on localhost."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    cmd = [str(BIN / "torchrun"), "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=localhost:{port}", f"--rdzv_id={run_id}",
           "scripts/train.py", "--output_dir", str(out), *TINY]  # fmt: skip
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
def two_nodes(runs) -> tuple[Path, list[subprocess.CompletedProcess]]:
    out = runs / "two_nodes"
    return out, two_agents(out)


@pytest.fixture(scope="module")
def pipeline(runs) -> Path:
    out = runs / "pipeline"
    launch(["scripts/train.py", "--output_dir", str(out), *TINY, "--pipeline_parallel_size", "2"])
    return out


def eval_loss(out: Path) -> float:
    return [r["eval_loss"] for r in read_metrics(out) if "eval_loss" in r][-1]


def assert_same_training(got: Path, ref: Path, rtol: float) -> None:
    a, b = train_rows(got), train_rows(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6, 8]
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= rtol * y["loss"], (x["step"], x["loss"], y["loss"])
    assert abs(eval_loss(got) - eval_loss(ref)) <= rtol * eval_loss(ref)
    assert_same_weights(got / "final", ref / "final", rtol=rtol, atol=1e-6)


def test_two_nodes_train_to_the_one_node_result(two_nodes, one_node):
    out, _ = two_nodes
    assert_same_training(out, one_node, rtol=1e-5)


def test_two_nodes_form_one_job_of_two_ranks(two_nodes):
    out, agents = two_nodes
    manifest = json.loads((out / "checkpoint-8" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    # Exactly one agent ran global rank 0 (it prints the summary and the sample completion).
    assert sum("Sample completion:" in a.stdout for a in agents) == 1
    assert (out / "final" / "config.json").is_file()


def test_pipeline_through_the_script_matches_the_data_parallel_run(pipeline, one_node):
    assert_same_training(pipeline, one_node, rtol=1e-4)
    config = json.loads((pipeline / "ds_config.json").read_text())
    assert config["pipeline"]["stages"] == 2
    assert config["zero_optimization"]["stage"] == 1
