"""``scripts/bench_moe.py``: expert parallelism against ZeRO-3 alone, each variant a real launch of
``scripts/train.py`` watched from outside for its largest process's memory; run small here (the
figures are in docs/benchmarks.md). The variants train the same steps on the same rows, so in fp32
(the suite's precision) the report's loss gap is rounding's: a variant that trained another model or
other rows would show it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.launch import ROOT, run_env

pytestmark = pytest.mark.distributed


def test_expert_parallelism_is_measured_against_zero3(tmp_path):
    report = tmp_path / "bench.json"
    cmd = [sys.executable, "scripts/bench_moe.py", "--max_steps", "4", "--size", "tiny", "--launcher", "torchrun",
           "--variants", "zero3,zero3_ep2", "--out", str(tmp_path / "runs"), "--json", str(report)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(report.read_text())
    assert list(results) == ["zero3", "zero3_ep2"]
    zero3, ep = results["zero3"], results["zero3_ep2"]
    assert zero3["tokens_per_second_ratio"] == zero3["peak_ratio"] == 1.0
    assert ep["tokens_per_second"] > 0 and ep["peak_bytes"] > 100e6  # a whole rank's process
    assert ep["peak_ratio"] == pytest.approx(ep["peak_bytes"] / zero3["peak_bytes"])
    assert len(ep["losses"]) == 4 and ep["loss_gap"] < 1e-5
    assert ep["losses"] == pytest.approx(zero3["losses"], rel=1e-5)
    assert "zero3_ep2" in proc.stdout and "loss gap" in proc.stdout
