"""py-cpuinfo's answer, asked once per machine: kept in a file named by the CPU, read by the processes
after the first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainer.runtime import cpu_info

cpuinfo = pytest.importorskip("cpuinfo")

PROC = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
cpu MHz\t\t: 2000.000
flags\t\t: fpu vme avx2 avx512f

processor\t: 1
vendor_id\t: GenuineIntel
cpu MHz\t\t: 3100.000
"""


def test_the_cpus_name_follows_what_identifies_it_and_nothing_else():
    name = cpu_info.identity(PROC)
    assert name is not None and name == cpu_info.identity(PROC.replace("2000.000", "2400.000"))
    assert name != cpu_info.identity(PROC.replace("avx512f", "avx512f amx_tile"))  # another CPU
    assert name != cpu_info.identity(PROC.replace("stepping\t: 8", "stepping\t: 6"))
    assert cpu_info.identity("") is None


@pytest.fixture
def fresh_cpuinfo(monkeypatch, tmp_path):
    """py-cpuinfo's own function, whatever an earlier test of this process kept (put back after)."""
    monkeypatch.setattr(cpuinfo, "get_cpu_info", sys.modules["cpuinfo.cpuinfo"].get_cpu_info)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if cpu_info.identity(Path("/proc/cpuinfo").read_text()) is None:
        pytest.skip("no /proc/cpuinfo")
    return tmp_path / "trainer" / "cpu_info"


def test_the_first_answer_is_written_and_the_next_process_reads_it(fresh_cpuinfo, monkeypatch):
    asked = cpuinfo.get_cpu_info
    cpu_info.keep_the_first_cpu_info()
    first = cpuinfo.get_cpu_info()
    (file,) = fresh_cpuinfo.glob("*.json")
    assert json.loads(file.read_text()) == first and {"arch", "flags", "vendor_id_raw"} <= set(first)
    assert cpuinfo.get_cpu_info() is first  # the process asks once

    # The next process: py-cpuinfo itself is not asked again; the file answers.
    file.write_text(json.dumps({**first, "brand_raw": "read from the file"}))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)
    cpu_info.keep_the_first_cpu_info()
    assert cpuinfo.get_cpu_info()["brand_raw"] == "read from the file"


def test_a_damaged_file_is_asked_again_and_rewritten(fresh_cpuinfo):
    name = cpu_info.identity(Path("/proc/cpuinfo").read_text())
    fresh_cpuinfo.mkdir(parents=True)
    (fresh_cpuinfo / f"{name}.json").write_text("{half a fi")
    cpu_info.keep_the_first_cpu_info()
    answer = cpuinfo.get_cpu_info()
    assert "flags" in answer and json.loads((fresh_cpuinfo / f"{name}.json").read_text()) == answer
