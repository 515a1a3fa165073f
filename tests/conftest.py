"""Session fixtures and hooks; the helpers that launch runs are in ``tests/helpers/launch.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# On a CPU with bf16 matrix instructions (AMX, AVX-512 BF16) precision "auto" is bf16
# (trainer/runtime/cpu_info.py). The suite's comparisons are fp32's, so it runs them in fp32 on every
# machine; tests/e2e/test_precision_auto.py turns the instructions on by the same switch.
os.environ.setdefault("TRAINER_CPU_BF16", "off")


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def matrix_runs(tmp_path_factory):
    """The launch matrix's runs (``tests/helpers/matrix.py``), each launched once per session, on
    first use, for every module that reads it."""
    from tests.helpers.matrix import MatrixRuns

    return MatrixRuns(tmp_path_factory.mktemp("matrix"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """How ``make test`` (``-n 2 --dist loadgroup``) shares two cores: every ``distributed`` test is
    in one group, which one worker runs one at a time, since each launch of two or more ranks wants
    every core; the other worker runs the rest a module at a time (its module-scoped fixtures are
    built once), filling the cores a launch leaves idle while it starts, gathers or writes."""
    for item in items:
        group = "ranks" if item.get_closest_marker("distributed") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # A stable sort: the modules of BEFORE_THE_OPS first, everything else in its order.
    items.sort(
        key=lambda item: not (item.get_closest_marker("distributed") and item.path.name in BEFORE_THE_OPS)
    )


# Distributed modules whose runs load none of DeepSpeed's JIT ops (no offload, no FusedAdam, no run of
# HF's Trainer or plain DeepSpeed on two ranks), about ten minutes of launches: the distributed
# worker runs them first, while scripts/warm_ops.py builds the ops the other modules load, which
# would otherwise wait for the build.
BEFORE_THE_OPS = (
    "test_fault_campaign.py",
    "test_fault_tolerance.py",
    "test_streaming.py",
    "test_tensor_parallel.py",
    "test_lars.py",
    "test_muon.py",
    "test_output_dir_lock.py",
    "test_pipeline.py",
    "test_tiling_zero.py",
)


# The worker of one-process tests yields to the distributed one: the launches are the suite's
# critical path, and this worker's processes (children included) fill the cores they leave idle.
ONE_PROCESS_NICENESS = 10


def pytest_runtest_setup(item) -> None:
    if hasattr(item.config, "workerinput") and not item.get_closest_marker("distributed"):
        niceness = os.getpriority(os.PRIO_PROCESS, 0)
        if niceness < ONE_PROCESS_NICENESS:
            os.setpriority(os.PRIO_PROCESS, 0, ONE_PROCESS_NICENESS)


def pytest_configure(config) -> None:
    """pytest 9.2 keeps a test's id where xdist 3.8 does not write its group: under ``--dist
    loadgroup`` no test would be in a group, and launches would run on both workers at once, four
    ranks on two cores (a suite of 46 minutes instead of 33). Stop before anything runs."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} breaks xdist's --dist loadgroup; install the pytest of "
            ".ci/constraints.txt (make install-dev does)"
        )


def pytest_sessionfinish(session, exitstatus) -> None:
    """Runs of plain DeepSpeed (the benchmark baselines) leave their all-reduce buffers in RAM-backed
    /dev/shm; a long suite would otherwise leak gigabytes. Under xdist, once, after every worker is
    done: a worker that finishes first must not sweep under the other's running launch."""
    if hasattr(session.config, "workerinput"):
        return
    from trainer.runtime.distributed import sweep_orphan_shm_buffers

    sweep_orphan_shm_buffers()
