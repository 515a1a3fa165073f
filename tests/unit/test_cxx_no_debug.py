"""scripts/cxx_no_debug.sh, the compiler ``make test`` gives DeepSpeed's JIT ops on a CPU box: every
argument but ``-g`` reaches the compiler, in order and whole."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.launch import ROOT


def test_it_passes_every_argument_but_debug_info(tmp_path):
    compiler = tmp_path / "cxx"  # a stand-in that prints the arguments it was given
    compiler.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    compiler.chmod(0o755)
    args = ["-O3", "-g", "-DNAME=a b", "-c", "x.cpp", "-gsplit-dwarf", "-g"]
    proc = subprocess.run([str(ROOT / "scripts" / "cxx_no_debug.sh"), *args], env={"TEST_CXX": str(compiler)},
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(proc.stdout) == ["-O3", "-DNAME=a b", "-c", "x.cpp", "-gsplit-dwarf"]
