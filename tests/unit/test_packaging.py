"""pyproject.toml: the distribution's name, its console script, and dependency floors the code really needs."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import trainer
from tests.helpers.launch import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The oldest version of each dependency that has every API the code uses, and why.
NEEDED = {
    "transformers": (
        "5.24",
        "create_causal_mask(cache=...) in trainer/engine/pipeline_layers.py; dtype= (4.56)",
    ),
    "datasets": ("4.0", "datasets.List in trainer/data/processing.py"),
    "torch": ("2.6", "transformers 5 disables torch below 2.6"),
    "accelerate": ("1.1", "transformers' HfDeepSpeedConfig requires accelerate>=1.1.0"),
    "deepspeed": ("0.19", "the config schema and CPU behaviour are DeepSpeed 0.19's"),
}


def declared() -> dict[str, Requirement]:
    return {req.name: req for req in map(Requirement, PROJECT["dependencies"])}


def floor(req: Requirement) -> Version:
    return Version(next(s.version for s in req.specifier if s.operator == ">="))


def test_distribution_is_not_named_like_the_pypi_trainer_package():
    assert PROJECT["name"] == "ds-llm-trainer"
    assert PROJECT["scripts"] == {"trainer": "trainer.cli.main:entry"}  # the command keeps its name
    dist = importlib.metadata.distribution("ds-llm-trainer")
    assert dist.version == trainer.__version__ == PROJECT["version"]
    assert [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "console_scripts"] == [
        ("trainer", "trainer.cli.main:entry")
    ]


def test_declared_floors_cover_the_apis_used():
    deps = declared()
    for name, (needed, why) in NEEDED.items():
        assert floor(deps[name]) >= Version(needed), f"{name}: needs >={needed} ({why})"


def test_installed_versions_are_inside_the_declared_ranges():
    for name, req in declared().items():
        installed = re.sub(r"\+.*", "", importlib.metadata.version(name))  # 2.13.0+cpu -> 2.13.0
        assert req.specifier.contains(installed, prereleases=True), f"{name} {installed} not in {req}"


def test_the_benchmark_is_packaged_but_not_imported_by_the_package():
    """``trainer.bench`` ships with the distribution; ``import trainer`` and the config CLI's
    ``trainer.config`` stay light and never load it."""
    setuptools = pytest.importorskip("setuptools")
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert "trainer.bench" in setuptools.find_packages(str(ROOT), **find)
    code = (
        "import sys, trainer, trainer.config; "
        "print(sorted(m for m in sys.modules if m.startswith('trainer.bench')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("make") is None, reason="one core")
def test_the_demo_uses_every_core_whatever_the_shell_set():
    """``nproc`` answers OMP_NUM_THREADS when it is set: a shell with 1 there gave the demo 1 thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"}
    proc = subprocess.run(["make", "-n", "-s", "demo"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    demo = [line for line in proc.stdout.splitlines() if line.endswith("scripts/train.py")]
    if "deepspeed" in demo[0]:
        pytest.skip("a GPU box launches one rank per GPU")
    assert demo == [f"OMP_NUM_THREADS={len(os.sched_getaffinity(0))} .venv/bin/python scripts/train.py"]
