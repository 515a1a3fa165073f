"""Every command that README.md and docs/ show is run by a test, or its doc says why not.

The commands are the lines of fenced code blocks that start a program users type. Each kind has
one rule:

- a launch of ``scripts/train.py`` (deepspeed, torchrun, accelerate launch, python) must be a case of
  the launch matrix (``test_launch_matrix.CASES``): the same launcher and the same arguments. The
  matrix runs it with the job sized to 2 CPU ranks and a tiny model appended;
- ``trainer ds-config`` and ``trainer plan`` run here, as written (shell blocks only: Python
  examples are not commands);
- other scripts (``scripts/bench*.py``, ``trainer plot``) are run, scaled down, by the test module
  that SCRIPT_TESTS names;
- a line that cannot run on one CPU machine (GPUs, several nodes, a SLURM cluster) is preceded in its
  block by a comment ``# not run by the tests: <why>``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.e2e.test_launch_matrix import CASES
from tests.helpers.launch import ROOT, run_env

PROGRAMS = ("deepspeed", "torchrun", "accelerate", "python", "trainer", "make", "sbatch")
NOT_RUN = "# not run by the tests:"
# Launcher options that only size the job (the matrix sizes it to 2 CPU ranks) or restart it.
SIZING = {"--num_gpus", "--nproc_per_node", "--num_processes", "--max-restarts", "--max_restarts"}
SIZING_FLAGS = {"--multi_gpu"}
# Scripts run by a test module of their own, with smaller arguments.
SCRIPT_TESTS = {
    "scripts/bench.py": "tests/e2e/test_bench.py",
    "scripts/bench_checkpoint.py": "tests/e2e/test_bench_checkpoint.py",
    "scripts/bench_comm.py": "tests/e2e/test_bench_comm.py",
    "scripts/bench_long_context.py": "tests/e2e/test_bench_long_context.py",
    "scripts/fault_campaign.py": "tests/e2e/test_fault_campaign.py",
    "trainer plot": "tests/unit/test_plot.py",
    "trainer.bench.activation_memory": "tests/unit/test_planner_long_context.py",
}
# The README's two commands: CI runs `make test`; `make demo` is the embedded default, the
# `deepspeed-default` case of the matrix at full length.
MAKE_TARGETS = {"make demo", "make test"}


def doc_commands() -> list[tuple[str, str, bool]]:
    """(doc file, command, marked not-run) for every command line in a fenced block."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M):
            if lang not in ("", "bash", "sh", "console"):
                continue  # Python examples, YAML recipes
            marked = False
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line.startswith(NOT_RUN):
                    marked = True
                    continue
                words = line.split()
                if words and words[0] in PROGRAMS and "=" not in words[0]:
                    found.append((path.name, line.split(" #")[0].strip(), marked))
                    marked = False
    return found


COMMANDS = doc_commands()


def launch_case(command: str) -> tuple[str, tuple[str, ...]] | None:
    """(launcher, script arguments) of a scripts/train.py launch; None for other commands."""
    words = shlex.split(command)
    if "scripts/train.py" not in words:
        return None
    at = words.index("scripts/train.py")
    launcher, options = words[0], words[1:at]
    if launcher == "accelerate":
        assert options[:1] == ["launch"], command
        options = options[1:]
    i = 0
    while i < len(options):
        name = options[i].split("=")[0]
        if name in SIZING_FLAGS:
            i += 1
        elif name in SIZING:
            i += 1 if "=" in options[i] else 2
        else:
            raise AssertionError(f"{command}: launcher option {name} is not run by the matrix; mark it")
    return launcher, tuple(words[at + 1 :])


def test_the_docs_show_commands():
    launches = [c for _, c, marked in COMMANDS if not marked and launch_case(c)]
    assert len(launches) >= 6, launches


TOOLS = ("trainer ds-config", "trainer plan")
TOOL_COMMANDS = [c for _, c, marked in COMMANDS if not marked and c.startswith(TOOLS)]


@pytest.mark.parametrize(
    "doc,command", [(d, c) for d, c, marked in COMMANDS if not (marked or c.startswith(TOOLS))]
)
def test_every_runnable_command_is_run_by_a_test(doc, command):
    case = launch_case(command)
    if case is not None:
        assert case in {(c.launcher, c.args) for c in CASES.values()}, (
            f"{doc}: `{command}` is not a case of tests/e2e/test_launch_matrix.py"
        )
    elif command in MAKE_TARGETS:
        pass
    else:
        script = next((s for s in SCRIPT_TESTS if s in command), None)
        assert script is not None, f"{doc}: `{command}` is run by no test; mark it `{NOT_RUN} <why>`"
        assert script.split()[-1] in (ROOT / SCRIPT_TESTS[script]).read_text()


TOOL_COMMANDS = [
    c for _, c, marked in COMMANDS if not marked and c.startswith(("trainer ds-config", "trainer plan"))
]


def test_tool_commands_run_as_written(tmp_path):
    """The config and planner commands, exactly as shown, in a scratch copy of the repository's
    ds_configs (``presets`` rewrites them) with the placeholder file the docs name."""
    assert TOOL_COMMANDS
    shutil.copytree(ROOT / "ds_configs", tmp_path / "ds_configs")
    shutil.copy(ROOT / "ds_configs" / "zero2_bf16.json", tmp_path / "my_ds.json")
    for command in TOOL_COMMANDS:
        words = shlex.split(command)
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.cli.main", *words[1:]],
            cwd=tmp_path,
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"`{command}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), command
    for preset in (ROOT / "ds_configs").glob("*.json"):
        assert (tmp_path / "ds_configs" / preset.name).read_text() == preset.read_text(), preset.name


def test_marked_commands_say_why():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            if line.strip().startswith(NOT_RUN):
                assert len(line.strip()) > len(NOT_RUN) + 8, f"{path.name}: {line}"
