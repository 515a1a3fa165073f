"""scripts/bench_preference.py scaled down (a tiny Llama, ZeRO-3, 3 steps of 2 ranks): the report holds
the three systems, and they trained the same job: the same losses, step by step. Timings and memory are
reported, never asserted."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.launch import launch

pytestmark = pytest.mark.distributed


def test_ours_and_trl_train_the_same_dpo_job_on_zero3(tmp_path):
    report = tmp_path / "report.json"
    proc = launch(
        ["scripts/bench_preference.py", "--stages", "3", "--steps", "3", "--warmup", "1", "--hidden_size", "64",
         "--layers", "2", "--pairs", "32", "--pairs_per_rank", "2", "--max_length", "64", "--learning_rate", "1e-2",
         "--root", str(tmp_path / "job"), "--json", str(report)],
        launcher="python", timeout=900,
    )  # fmt: skip
    results = json.loads(report.read_text())
    assert [(r["zero_stage"], r["system"]) for r in results] == [
        (3, "ours"),
        (3, "ours_ref_model"),
        (3, "trl"),
    ]
    ours, ref_model, trl = results
    for r in results:
        assert r["world_size"] == 2 and r["engine_zero_stage"] == 3 and len(r["step_s"]) == 3
        assert r["peak_rss_bytes"] > 0 and r["steps_per_s"] > 0
    assert ours["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    # The same pairs in the same order: the curves agree to rounding (another order differs by 1e-2);
    # the base as a partitioned ref_model scores what the policy's own pass scores.
    assert ours["losses"] == pytest.approx(trl["losses"], rel=1e-4)
    assert ref_model["losses"] == pytest.approx(ours["losses"], rel=1e-5)
    assert ours["losses"][-1] != pytest.approx(ours["losses"][0], rel=1e-3)  # the steps moved the policy
    assert "| 3 | trl |" in proc.stdout and "over ours: memory" in proc.stdout
