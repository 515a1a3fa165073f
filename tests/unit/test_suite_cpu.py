"""``make test-cpu``'s accounting: each Python process started with ``scripts/cpu_account`` first on
its path logs its own CPU and test at exit, and ``scripts/suite_cpu.py`` sums the log."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import ROOT, run_env


def test_a_child_process_logs_its_program_cpu_and_test(tmp_path):
    log = tmp_path / "cpu.jsonl"
    env = run_env(
        PYTHONPATH=str(ROOT / "scripts" / "cpu_account"),
        SUITE_CPU_LOG=str(log),
        PYTEST_CURRENT_TEST="tests/unit/test_x.py::test_y (call)",
    )
    for _ in range(2):  # appended, not overwritten
        subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], env=env, check=True, timeout=60)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["argv"] for r in rows] == [["-c"], ["-c"]]
    assert all(r["test"] == "tests/unit/test_x.py::test_y (call)" and r["cpu_s"] > 0 for r in rows), rows


def test_the_report_sums_by_program_and_by_test_module(tmp_path):
    log = tmp_path / "cpu.jsonl"
    rows = [
        {"argv": ["/r/scripts/train.py", "--x"], "cpu_s": 8.0, "test": "tests/e2e/test_a.py::t1 (setup)"},
        {"argv": ["/r/scripts/train.py"], "cpu_s": 9.0, "test": "tests/e2e/test_b.py::t2 (call)"},
        {
            "argv": ["/v/torch/distributed/run.py", "--nproc_per_node"],
            "cpu_s": 1.5,
            "test": "tests/e2e/test_a.py::t1 (setup)",
        },
        {"argv": ["-c"], "cpu_s": 60.0, "test": ""},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "scripts/suite_cpu.py", str(log)], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)  # fmt: skip
    lines = proc.stdout.splitlines()
    assert lines[0] == "4 Python processes, 1.3 CPU-minutes of their own"
    programs = lines[lines.index("| program | processes | CPU s |") + 2 :][:3]
    assert programs == ["| -c | 1 | 60 |", "| train.py | 2 | 17 |", "| run.py | 1 | 2 |"]
    modules = lines[lines.index("| test module | processes | CPU s |") + 2 :]
    assert modules == [
        "| (outside a test) | 1 | 60 |",
        "| tests/e2e/test_a.py | 2 | 10 |",
        "| tests/e2e/test_b.py | 1 | 9 |",
    ]
