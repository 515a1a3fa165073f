"""Session fixtures and hooks; the helpers that launch runs are in ``tests/helpers/launch.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def matrix_runs(tmp_path_factory):
    """The launch matrix's runs (``tests/helpers/matrix.py``), each launched once per session, on
    first use, for every module that reads it."""
    from tests.helpers.matrix import MatrixRuns

    return MatrixRuns(tmp_path_factory.mktemp("matrix"))


def pytest_sessionfinish(session, exitstatus) -> None:
    """Runs of plain DeepSpeed (the benchmark baselines) leave their all-reduce buffers in RAM-backed
    /dev/shm; a long suite would otherwise leak gigabytes."""
    from trainer.runtime.distributed import sweep_orphan_shm_buffers

    sweep_orphan_shm_buffers()
