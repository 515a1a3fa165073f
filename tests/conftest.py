"""Session fixtures and hooks; the helpers that launch runs are in ``tests/helpers/launch.py``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("session")


def pytest_sessionfinish(session, exitstatus) -> None:
    """Runs of plain DeepSpeed (the benchmark baselines) leave their all-reduce buffers in RAM-backed
    /dev/shm; a long suite would otherwise leak gigabytes."""
    from trainer.runtime.distributed import sweep_orphan_shm_buffers

    sweep_orphan_shm_buffers()
