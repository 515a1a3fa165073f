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
    # The steps moved the policy: by 1e-2 of the loss when run alone, by 7.5e-4 once in a full
    # suite (ours and TRL alike; why the job differed there is not known), far above rounding (1e-7).
    assert ours["losses"][-1] != pytest.approx(ours["losses"][0], rel=1e-4)
    assert "| 3 | trl |" in proc.stdout and "over ours: memory" in proc.stdout


def test_the_longest_pair_search_stops_each_system_at_the_cap(tmp_path):
    """``--longest`` scaled down (a 2-layer model, 2 heads, sequences of 96 tokens): under a cap no run
    reaches, each system trains there; under a cap below any Python process's size, each is stopped
    at its first length and has no longest pair."""
    start = ["scripts/bench_preference.py", "--hidden_size", "128", "--layers", "2", "--pairs", "8",
             "--model_vocab", "4096", "--lengths", "96"]  # fmt: skip
    found = {}
    for cap in (100_000, 50):
        report = tmp_path / f"longest-{cap}.json"
        proc = launch([*start, "--longest", str(cap), "--root", str(tmp_path / f"job-{cap}"), "--json", str(report)],
                      launcher="python", timeout=900)  # fmt: skip
        found[cap] = json.loads(report.read_text())
        assert f"longest pair under {cap} MiB" in proc.stdout
    names = ["ours, untiled", "ours, tiled loss", "ours, tiled loss, SP=2", "trl"]
    assert [r["system"] for r in found[100_000]] == [r["system"] for r in found[50]] == names
    for r in found[100_000]:
        assert r["longest"] == 96 and r["peak_rss_bytes"] > 0 and r["step_s"] > 0, r
    for r in found[50]:
        assert r["longest"] is None and [(p["length"], p["stopped"]) for p in r["probes"]] == [(96, "cap")], r
